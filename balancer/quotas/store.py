"""Quotas in PostgreSQL (the source of truth), mirrored live into Redis.

Every change runs in one PostgreSQL transaction that locks the row and writes
the new value and an audit row; an import writes every model in one
transaction. Only after the commit is the change pushed to the admission core,
in one Redis transaction (all of an import, or none of it), so Redis never
enforces a value PostgreSQL did not store. Writers (and the
drift repair) hold one advisory lock from their transaction to the end of their
push, so two changes reach Redis in the order they were committed. If the push
fails (Redis down), the change is stored and :class:`LiveNotUpdated` says so;
:meth:`QuotaStore.repair_drift`, run on every sweep tick, then makes Redis
match PostgreSQL again, and logs what it changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from balancer.admission.fields import quota_fields
from balancer.admission.quota import Quota
from balancer.errors import QuotaError
from balancer.quotas.file import PRICES, in_the_files_currency
from balancer.quotas.rows import QUOTA_COLUMNS, all_quotas, quota_from_row
from balancer.storage import audit
from balancer.storage.audit import default_actor
from balancer.storage.declared import ImportSummary, change, import_set
from balancer.storage.schema import quota_changes, quotas

#: One model's row, as :func:`~balancer.quotas.rows.quota_from_row` reads it.
_SELECT = sa.select(*(quotas.c[name] for name in QUOTA_COLUMNS))


class LiveQuotas(Protocol):
    """What the store needs from the admission core."""

    def apply_quotas(self, changes: Sequence[tuple[str, Quota | None]]) -> None: ...

    def live_quotas(self) -> dict[str, Quota]: ...

    def restore(self) -> bool: ...


#: pg_advisory_lock key shared by every quota writer and the drift repair ("bal.quota").
QUOTA_LOCK = 0x62616C2E71756F74


class LiveNotUpdated(QuotaError):
    """The change is stored in PostgreSQL, but pushing it to Redis failed."""


Change = tuple[Quota | None, Quota | None]  # (old, new); new None = removed


class QuotaStore:
    def __init__(self, engine: Engine, live: LiveQuotas | None = None) -> None:
        self.engine = engine
        self.live = live

    # -- reads -----------------------------------------------------------------
    def all(self) -> list[Quota]:
        return all_quotas(self.engine)

    def get(self, name: str) -> Quota | None:
        with self.engine.connect() as conn:
            row = conn.execute(_SELECT.where(quotas.c.name == name)).first()
        return quota_from_row(row) if row else None

    def history(self, name: str | None = None) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            return audit.history(conn, quota_changes, name)

    def removed(self, names: Sequence[str] | None) -> dict[str, dict[str, Any]]:
        """Those of ``names`` (None: every model) whose last create, update or remove row
        removes them: that row (a learned limit's row, written from a live view read before
        the removal, may come after it and is skipped)."""
        by_person = quota_changes.c.action.in_(("create", "update", "remove"))
        named = [] if names is None else [quota_changes.c.model.in_(list(names))]
        with self.engine.connect() as conn:
            rows = conn.execute(audit.last_per_subject(quota_changes, by_person, *named))
            return {r.model: dict(r._mapping) for r in rows if r.action == "remove"}

    # -- writes ----------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self, reset: bool = False) -> Iterator[tuple[Connection, list[Change]]]:
        """One serialized quota write: a transaction, committed, then its changes
        pushed to the live state (with ``reset``, each one, changed or not: :meth:`_push`),
        all under :data:`QUOTA_LOCK`."""
        changes: list[Change] = []
        if self.live is not None:
            # A missing live state is rebuilt from the set *before* this change, so
            # a model created now starts with full buckets, as a new model should.
            with contextlib.suppress(Exception):  # Redis down: the push below says so
                self.live.restore()
        with self.engine.connect() as conn:
            conn.execute(sa.select(sa.func.pg_advisory_lock(QUOTA_LOCK)))
            conn.commit()
            try:
                with conn.begin():
                    yield conn, changes
                self._push(changes, reset)
            finally:
                try:
                    conn.execute(sa.select(sa.func.pg_advisory_unlock(QUOTA_LOCK)))
                    conn.commit()
                except Exception:  # noqa: BLE001 - a dead session holds no lock; a live one must not keep it
                    conn.invalidate()

    def _push(self, changes: Sequence[Change], reset: bool = False) -> None:
        """Send the changes Redis holds to the live state: a model created or removed, or
        one whose :func:`quota_fields` changed. A change of price or currency alone stays in
        PostgreSQL (admission has no use for it), so it forgets nothing the model learned;
        with ``reset`` (``quota set``) every change is sent, so the model forgets what it
        learned and any debt (set_quota.lua) even when its limits stay."""
        live = [((new or old).name, new) for old, new in changes  # type: ignore[union-attr]
                if reset or old is None or new is None or quota_fields(old) != quota_fields(new)]
        if self.live is None or not live:
            return
        try:  # one transaction: an import reaches Redis whole, or not at all
            self.live.apply_quotas(live)
        except Exception as exc:  # noqa: BLE001 - stored in PostgreSQL; the drift repair pushes it later
            raise LiveNotUpdated(
                f"stored, but the live state was not updated ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "the dispatcher's sweep tick applies it when Redis is back"
            ) from None

    def repair_drift(self) -> list[str]:
        """Make the live state match PostgreSQL (a push lost to a Redis outage,
        a hand edit); returns the models it changed, for the log."""
        if self.live is None:
            return []
        with self._writing() as (conn, changes):
            stored = {q.name: q for q in all_quotas(conn)}
            live = self.live.live_quotas()
            for name, quota in stored.items():
                current = live.get(name)  # as Redis holds it: compare what Redis holds
                if current is None or quota_fields(current) != quota_fields(quota):
                    changes.append((current, quota))
            for name in live.keys() - stored.keys():
                changes.append((live[name], None))
        return sorted({(new or old).name for old, new in changes})  # type: ignore[union-attr]

    def _locked(self, conn: Connection, name: str) -> Quota | None:
        row = conn.execute(_SELECT.where(quotas.c.name == name).with_for_update()).first()
        return quota_from_row(row) if row else None

    def set(self, name: str, changes: dict[str, Any], *, create: bool = False, by: str | None = None,
            reset: bool = False) -> tuple[Quota | None, Quota]:
        """Change (or with ``create``, add) one model. Returns (old, new). With ``reset``
        its live state forgets what it learned and any debt, even if nothing changed (:meth:`_push`)."""
        by = by or default_actor()
        with self._writing(reset) as (conn, pushed):
            old = self._locked(conn, name)
            if old is None:
                flags = {"max_concurrent_requests": "--concurrency", "max_tokens_per_minute": "--tpm"}
                needs = " and ".join(flag for field, flag in flags.items() if changes.get(field) is None)
                if not create:  # what adding it takes, all in one line
                    raise QuotaError(f"unknown model {name!r}: add it with --create" + (f" and {needs}" if needs else ""))
                if needs:
                    raise QuotaError(f"creating {name!r} needs {needs}")
                new = Quota(name=name, **changes)
            else:
                new = old.replace(**changes)
            if changes.keys() & {*PRICES, "currency"}:
                new = in_the_files_currency(new, all_quotas(conn))
            if new != old:
                change(conn, _QuotaSet(pushed), old, new, by=by)
            elif reset:
                pushed.append((old, new))  # unchanged: only the live state's reset
        return old, new

    def remove(self, name: str, *, by: str | None = None, check: Callable[[Connection], None] | None = None) -> Quota:
        """Delete one model; ``check`` runs in the transaction, with the row
        locked, and may refuse (raise) or act on the model's tasks."""
        with self._writing() as (conn, changes):
            old = self._locked(conn, name)
            if old is None:
                raise QuotaError(f"unknown model {name!r}")
            if check is not None:
                check(conn)
            change(conn, _QuotaSet(changes), old, None, by=by or default_actor())
        return old

    def replace_all(
        self, new_set: Sequence[Quota], *, by: str | None = None, allow_removal: bool = True, dry_run: bool = False
    ) -> ImportSummary:
        """Make the stored set equal to ``new_set`` (import), in one transaction.

        With ``allow_removal`` False, an import that would remove a model
        changes nothing and raises :class:`QuotaError` listing them; with
        ``dry_run``, nothing is written and the summary says what would be.
        """
        with self._writing() as (conn, changes):
            return import_set(conn, _QuotaSet(changes, allow_removal=allow_removal or dry_run), new_set,
                              by=by or default_actor(), whole=True, dry_run=dry_run)


class _QuotaSet:
    """Quotas as :func:`~balancer.storage.declared.import_set` stores them: each change written
    to ``quotas`` and kept in ``pushed``, for the live state once committed."""

    table, changes, created = quotas, quota_changes, "create"
    lock = sa.text("LOCK TABLE quotas IN SHARE ROW EXCLUSIVE MODE")

    def __init__(self, pushed: list[Change], *, allow_removal: bool = True) -> None:
        self.pushed = pushed
        self.allow_removal = allow_removal

    def read(self, conn: Connection) -> dict[str, Quota]:
        return {q.name: q for q in all_quotas(conn)}

    def refuse(self, conn: Connection, summary: ImportSummary, current: Mapping[str, Quota],
               wanted: Mapping[str, Quota]) -> None:
        if summary.removed and not self.allow_removal:
            raise QuotaError(
                f"this import would remove {len(summary.removed)} model(s) ({', '.join(summary.removed)}): "
                "check with --dry-run, then pass --replace"
            )

    def write(self, conn: Connection, old: Quota | None, new: Quota | None, *, by: str) -> dict[str, Any]:
        if new is not None and old is None:
            conn.execute(sa.insert(quotas).values(**new.as_dict()))
        elif new is not None:
            conn.execute(sa.update(quotas).where(quotas.c.name == new.name).values(**new.as_dict(),
                                                                                   updated_at=sa.func.now()))
        elif old is not None:
            conn.execute(sa.delete(quotas).where(quotas.c.name == old.name))
        self.pushed.append((old, new))
        return {}

    def settle(self, conn: Connection, old: Quota | None, new: Quota, *, by: str) -> None:
        pass

"""Quotas in PostgreSQL (the source of truth), mirrored live into Redis.

Every change runs in one PostgreSQL transaction that locks the row, writes
the new value and an audit row, pushes the value to the admission core, and
only then commits. If the push fails (Redis down), the transaction rolls
back: nothing half-written.
"""

from __future__ import annotations

import getpass
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from balancer.domain.quota import Quota
from balancer.errors import QuotaError
from balancer.storage.schema import quota_changes, quotas


class LiveQuotas(Protocol):
    """What the store needs from the admission core."""

    def set_quota(self, quota: Quota) -> None: ...

    def remove_quota(self, name: str) -> bool: ...


def default_actor() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return "unknown"


def _row_to_quota(row: Any) -> Quota:
    return Quota(
        name=row.name,
        weight=row.weight,
        max_concurrent_requests=row.max_concurrent_requests,
        max_tokens_per_minute=row.max_tokens_per_minute,
        max_requests_per_minute=row.max_requests_per_minute,
        burst_tokens=row.burst_tokens,
        enabled=row.enabled,
        token_accounting=row.token_accounting,
        burst_requests=row.burst_requests,
        expected_latency_s=row.expected_latency_s,
        on_disconnect=row.on_disconnect,
    )


@dataclass
class ImportSummary:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)


def import_diff(current: Mapping[str, Quota], wanted: Mapping[str, Quota]) -> ImportSummary:
    """What replacing ``current`` with ``wanted`` does, model by model (pure).

    >>> a, b = Quota("a", 1, 10), Quota("b", 1, 10)
    >>> import_diff({"a": a, "b": b}, {"a": a.replace(weight=2), "c": Quota("c", 1, 10)})
    ImportSummary(created=['c'], updated=['a'], removed=['b'], unchanged=[])
    """
    summary = ImportSummary(removed=sorted(current.keys() - wanted.keys()))
    for name in sorted(wanted):
        old = current.get(name)
        if old == wanted[name]:
            summary.unchanged.append(name)
        else:
            (summary.updated if old else summary.created).append(name)
    return summary


class QuotaStore:
    def __init__(self, engine: Engine, live: LiveQuotas | None = None) -> None:
        self.engine = engine
        self.live = live

    # -- reads -----------------------------------------------------------------
    def all(self) -> list[Quota]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(quotas).order_by(quotas.c.name)).all()
        return [_row_to_quota(r) for r in rows]

    def get(self, name: str) -> Quota | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(quotas).where(quotas.c.name == name)).first()
        return _row_to_quota(row) if row else None

    def history(self, name: str | None = None) -> list[dict[str, Any]]:
        query = sa.select(quota_changes).order_by(quota_changes.c.id)
        if name is not None:
            query = query.where(quota_changes.c.model == name)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]

    # -- writes ----------------------------------------------------------------
    def _write(self, conn: Connection, old: Quota | None, new: Quota | None, by: str) -> None:
        if new is None:
            if old is None:
                return  # nothing to remove, nothing to audit
            conn.execute(sa.delete(quotas).where(quotas.c.name == old.name))
            action = "remove"
        else:
            values = new.as_dict()
            if old is None:
                conn.execute(sa.insert(quotas).values(**values))
                action = "create"
            else:
                conn.execute(
                    sa.update(quotas).where(quotas.c.name == new.name).values(**values, updated_at=sa.func.now())
                )
                action = "update"
        conn.execute(
            sa.insert(quota_changes).values(
                model=(new or old).name,  # type: ignore[union-attr]
                changed_by=by,
                action=action,
                old_value=old.as_dict() if old else None,
                new_value=new.as_dict() if new else None,
            )
        )
        if self.live is not None:
            if new is None:
                self.live.remove_quota(old.name)  # type: ignore[union-attr]
            else:
                self.live.set_quota(new)

    def _locked(self, conn: Connection, name: str) -> Quota | None:
        row = conn.execute(sa.select(quotas).where(quotas.c.name == name).with_for_update()).first()
        return _row_to_quota(row) if row else None

    def set(self, name: str, changes: dict[str, Any], *, create: bool = False, by: str | None = None) -> tuple[Quota | None, Quota]:
        """Change (or with ``create``, add) one model. Returns (old, new)."""
        by = by or default_actor()
        with self.engine.begin() as conn:
            old = self._locked(conn, name)
            if old is None:
                if not create:
                    raise QuotaError(f"unknown model {name!r}: add it with --create")
                missing = [f for f in ("max_concurrent_requests", "max_tokens_per_minute") if changes.get(f) is None]
                if missing:
                    flags = {"max_concurrent_requests": "--concurrency", "max_tokens_per_minute": "--tpm"}
                    raise QuotaError(
                        f"creating {name!r} needs {' and '.join(flags[m] for m in missing)}"
                    )
                new = Quota(name=name, **changes)
            else:
                new = old.replace(**changes)
            if new != old:
                self._write(conn, old, new, by)
        return old, new

    def remove(self, name: str, *, by: str | None = None) -> Quota:
        with self.engine.begin() as conn:
            old = self._locked(conn, name)
            if old is None:
                raise QuotaError(f"unknown model {name!r}")
            self._write(conn, old, None, by or default_actor())
        return old

    def replace_all(
        self, new_set: Sequence[Quota], *, by: str | None = None, allow_removal: bool = True, dry_run: bool = False
    ) -> ImportSummary:
        """Make the stored set equal to ``new_set`` (import), in one transaction.

        With ``allow_removal`` False, an import that would remove a model
        changes nothing and raises :class:`QuotaError` listing them; with
        ``dry_run``, nothing is written and the summary says what would be.
        """
        by = by or default_actor()
        wanted = {q.name: q for q in new_set}
        with self.engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE quotas IN SHARE ROW EXCLUSIVE MODE"))
            current = {r.name: _row_to_quota(r) for r in conn.execute(sa.select(quotas))}
            summary = import_diff(current, wanted)
            if summary.removed and not allow_removal and not dry_run:
                raise QuotaError(
                    f"this import would remove {len(summary.removed)} model(s) ({', '.join(summary.removed)}): "
                    "check with --dry-run, then pass --replace"
                )
            if dry_run:
                return summary
            for name in summary.removed:
                self._write(conn, current[name], None, by)
            for name in summary.created + summary.updated:
                self._write(conn, current.get(name), wanted[name], by)
        return summary

"""Declared sources in balancer's database: import (audited, like quotas), list,
remove, and each source's read cursor. (Their status is read by
:mod:`balancer.sources.reads`.)

A source's row holds its definition (never a secret: only the name of the
variable holding its URL) and its cursor: ``position``, the largest key read,
and ``rescan``, how far the pass behind the cursor has come (it finds rows
that committed behind the cursor, e.g. a writer's transaction that took a
smaller id and committed late). The cursor moves only from the value it was
read at, in the transaction that inserts the batch's tasks
(:func:`advance`), so two ingesters never skip a row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Connection, Engine

from balancer.backlog.insert import share_answers
from balancer.backlog.intake import IntakeRules, TaskRow
from balancer.settings import Settings
from balancer.sources.catalog import FENCE_SEPARATOR
from balancer.sources.definition import SourceDef, SourceFileError, source_from_dict
from balancer.sources.removal import cancel_for_removal, left, refusal, resume
from balancer.sources.schema import source_outbox, sources
from balancer.sources.tables import own_relations
from balancer.sources.weights import set_weight
from balancer.storage import audit
from balancer.storage.declared import ImportSummary, import_set
from balancer.storage.schema import metadata, source_budgets, source_changes, source_weights, tasks

log = logging.getLogger(__name__)


def _definition(row: Any) -> SourceDef:
    return source_from_dict(row.name, dict(row.definition))


def all_sources(conn: Connection) -> list[SourceDef]:
    """Every declared source, by name. A stored definition today's checks refuse (a
    ``where`` that leaves its parentheses, imported before they existed) is left out,
    with a warning: nothing is read from or written to its table until it is imported again."""
    found = []
    for row in conn.execute(sa.select(sources.c.name, sources.c.definition).order_by(sources.c.name)):
        try:
            found.append(_definition(row))
        except SourceFileError as exc:
            log.warning("source %s skipped: %s; import it again", row.name, exc)
    return found


def _same_table_clash(wanted: Sequence[SourceDef], kept: Sequence[SourceDef],
                      relations: Mapping[str, Sequence[str]]) -> str | None:
    """The first two sources that read the same table: the same relation (whatever the
    spelling: ``relations``, resolved at import), or, where that is not known, the same spelling."""
    everyone = {d.name: d for d in kept} | {d.name: d for d in wanted}
    seen: dict[Any, str] = {}
    for d in sorted(everyone.values(), key=lambda d: d.name):
        spots = [("spelled", d.database_url_env, d.table)] + [("relation", r) for r in relations.get(d.name, ())]
        first = next((seen[spot] for spot in spots if spot in seen), None)
        if first is not None:
            return (f"sources {first} and {d.name} read the same table {d.table}: a table is one source "
                    "(import it once, under one name)")
        seen.update((spot, d.name) for spot in spots)
    return None


#: Balancer's own relations, never a source's table (its tables, and the results view).
OWN_RELATIONS = ("alembic_version", "balancer_results")


def _own_table_clash(conn: Connection, wanted: Sequence[SourceDef], relations: Mapping[str, Sequence[str]]) -> str | None:
    if not any(relations.get(d.name) for d in wanted):
        return None
    own = own_relations(conn, sorted(metadata.tables) + list(OWN_RELATIONS))
    for d in wanted:
        mine = next((own[r] for r in relations.get(d.name, ()) if r in own), None)
        if mine is not None:
            return f"sources.{d.name}: {d.table} is balancer's own table {mine}: a source is one of the team's tables"
    return None


def _taken_name(conn: Connection, created: Sequence[str]) -> str | None:
    """A new source's name under which tasks were submitted (JSONL or the inbox): a table
    source's name is its own, so they would share its keys, fair share and budget."""
    for name in created:
        if conn.execute(sa.select(tasks.c.id).where(tasks.c.source == name, tasks.c.from_table.is_(False))
                        .limit(1)).first() is not None:
            return (f"sources.{name}: tasks were submitted under the name {name} (JSONL or the inbox); "
                    "a table source's name is its own: choose another name")
    return None


def import_sources(engine: Engine, wanted: Sequence[SourceDef], *, by: str, replace: bool,
                   dry_run: bool, relations: Mapping[str, Sequence[str]] | None = None) -> ImportSummary:
    """Store ``wanted`` (create or update each), in one transaction, audited;
    with ``replace``, remove the sources not in it. Each source's weight is set
    in the same transaction. A changed table or key resets that source's cursor.
    ``relations``: the tables each source reads (:func:`balancer.sources.catalog.check_source`),
    stored with it; two sources reading one table, and a source on balancer's own tables, are refused."""
    with engine.begin() as conn:
        return import_set(conn, _SourceSet(relations or {}), wanted, by=by, whole=replace, dry_run=dry_run)


class _SourceSet:
    """Sources as :func:`~balancer.storage.declared.import_set` stores them."""

    table, changes, created = sources, source_changes, "import"
    lock = sa.text("LOCK TABLE sources IN SHARE ROW EXCLUSIVE MODE")

    def __init__(self, relations: Mapping[str, Sequence[str]]) -> None:
        self.relations = relations

    def read(self, conn: Connection) -> dict[str, SourceDef]:
        return {d.name: d for d in all_sources(conn)}

    def refuse(self, conn: Connection, summary: ImportSummary, current: Mapping[str, SourceDef],
               wanted: Mapping[str, SourceDef]) -> None:
        """Two sources on one table, one on balancer's own, a name JSONL tasks carry; a source
        removed while it has tasks or write-backs left."""
        stored = {row.name: row.relations or () for row in conn.execute(sa.select(sources.c.name, sources.c.relations))}
        kept = [d for name, d in sorted(current.items()) if name not in wanted and name not in summary.removed]
        known = {d.name: stored[d.name] for d in kept} | {name: self.relations.get(name, ()) for name in wanted}
        clash = (_own_table_clash(conn, list(wanted.values()), self.relations)
                 or _same_table_clash(list(wanted.values()), kept, known) or _taken_name(conn, summary.created))
        if clash:
            raise SourceFileError(clash)
        for name in summary.removed:
            if (going := left(conn, name)).anything:
                raise SourceFileError(refusal(name, going))

    def write(self, conn: Connection, old: SourceDef | None, new: SourceDef | None, *, by: str) -> dict[str, Any]:
        """A source created again resumes what its removal left (its counts, for the audit row)."""
        if new is None:
            if old is not None:
                _drop(conn, old.name)
            return {}
        values: dict[str, Any] = {"definition": new.as_dict(), "updated_at": sa.func.now()}
        if old is None:
            conn.execute(sa.insert(sources).values(name=new.name, **values))
            return resume(conn, new.name, by)
        if not old.reads_same_rows(new):
            values |= {"position": sa.null(), "rescan": sa.null(), "caught_up_at": None}
        conn.execute(sa.update(sources).where(sources.c.name == new.name).values(**values))
        return {}

    def settle(self, conn: Connection, old: SourceDef | None, new: SourceDef, *, by: str) -> None:
        """The tables it reads (resolved now, or kept while its table is the same) and its weight."""
        if new.name in self.relations:
            conn.execute(sa.update(sources).where(sources.c.name == new.name)
                         .values(relations=list(self.relations[new.name])))
        elif old is None or not old.same_table(new):
            conn.execute(sa.update(sources).where(sources.c.name == new.name).values(relations=None))
        set_weight(conn, new.name, new.weight, by=by)


def _drop(conn: Connection, name: str) -> None:
    """The source's definition, its write-backs, and the weight its import set (a budget per day
    is the source name's own setting, set apart, and stays for its JSONL tasks)."""
    conn.execute(sa.delete(sources).where(sources.c.name == name))
    conn.execute(sa.delete(source_outbox).where(source_outbox.c.source == name))
    conn.execute(sa.delete(source_weights).where(source_weights.c.source == name))


def remove_source(engine: Engine, name: str, *, by: str, cancel: bool = False) -> dict[str, Any]:
    """Remove a source (its tasks stay; its table is not read): refused while it has tasks not
    ended or write-backs waiting, unless ``cancel`` (:mod:`balancer.sources.removal`). What was
    cancelled and dropped."""
    with engine.begin() as conn:
        row = conn.execute(sa.select(sources.c.name, sources.c.definition)
                           .where(sources.c.name == name).with_for_update()).first()
        if row is None:
            budgeted = conn.execute(sa.select(source_budgets.c.source).where(source_budgets.c.source == name)).first()
            raise SourceFileError(f"no source table {name!r}: it has a budget per day, which stays for its JSONL tasks "
                                  f"(`balancer source set {name} --no-budget` clears it)" if budgeted
                                  else f"no source {name!r}")
        going = left(conn, name)
        if going.anything and not cancel:
            raise SourceFileError(refusal(name, going))
        done = cancel_for_removal(conn, name, by) if cancel else {}
        _drop(conn, name)
        # The definition as stored: one today's checks would refuse is removed all the same.
        audit.record(conn, source_changes, name, by=by, action="remove", old=dict(row.definition), new=done or None)
    return done


def intake_rules(conn: Connection, settings: Settings) -> IntakeRules:
    """What the JSONL lines inserted in the caller's transaction are held to: the size
    limits, and no table source's name. The names are read under ``ROW EXCLUSIVE`` on
    ``sources``, which a source's import (``SHARE ROW EXCLUSIVE``) waits for: a source
    declared while these lines are inserted is declared after they commit, and its import
    then sees them (:func:`_taken_name`)."""
    conn.execute(sa.text("LOCK TABLE sources IN ROW EXCLUSIVE MODE"))
    names = frozenset(conn.execute(sa.select(sources.c.name)).scalars())
    return IntakeRules(settings.max_prompt_bytes, settings.max_source_chars, names)


# One statement for a whole batch: its columns as arrays, unnested into rows (a
# VALUES list of thousands of rows costs more to send and parse than to insert).
# ``from_table``: these are the source's own rows, the only tasks written back to its table.
_INSERT_BATCH = sa.text("""
WITH inserted AS (
    INSERT INTO tasks (source, key, prompt, priority, max_tokens, estimated_tokens, allowed_models, source_fingerprint,
                       from_table)
    SELECT :source, r.key, r.prompt, r.priority, :max_tokens, r.estimated, :allowed,
           md5(convert_to(r.prompt, 'UTF8')) || coalesce(:separator || r.held, ''), true
    FROM unnest(:keys, :prompts, :priorities, :estimated, :held) AS r(key, prompt, priority, estimated, held)
    ON CONFLICT (source, key) WHERE key IS NOT NULL DO NOTHING
    RETURNING id
)
SELECT coalesce(array_agg(id), '{}') FROM inserted
""").bindparams(sa.bindparam("keys", type_=ARRAY(sa.Text)), sa.bindparam("prompts", type_=ARRAY(sa.Text)),
                sa.bindparam("priorities", type_=ARRAY(sa.Integer)), sa.bindparam("estimated", type_=ARRAY(sa.Integer)),
                sa.bindparam("allowed", type_=ARRAY(sa.Text)), sa.bindparam("held", type_=ARRAY(sa.Text)))


def insert_source_tasks(conn: Connection, source: str, max_tokens: int, allowed: tuple[str, ...] | None,
                        rows: list[TaskRow], *, held: Mapping[str, str] | None = None, dedup: bool = False) -> int:
    """Insert one batch of a source's tasks (all with its ``max_tokens`` and allowed
    models, each with its fence: :func:`balancer.sources.catalog.fence`, of its prompt and of
    what its row's written columns held when read, ``held`` by key), skipping keys already
    present; returns how many were inserted. With
    ``dedup``, they may take identical tasks' answers (:func:`balancer.backlog.insert.share_answers`)."""
    if not rows:
        return 0
    ids = list(conn.execute(_INSERT_BATCH, {
        "source": source, "max_tokens": max_tokens, "allowed": list(allowed) if allowed else None,
        "keys": [r.key for r in rows], "prompts": [r.prompt for r in rows],
        "priorities": [r.priority for r in rows], "estimated": [r.estimated_tokens for r in rows],
        "held": [(held or {}).get(r.key or "") for r in rows], "separator": FENCE_SEPARATOR,
    }).scalar_one())
    if dedup:
        share_answers(conn, ids)
    return len(ids)


@dataclass(frozen=True)
class Cursor:
    """Where a source's reading stands (keys as the team's database spells them, as text)."""

    position: str | None
    rescan: str | None


def recorded_relations(conn: Connection, name: str) -> list[str]:
    """The tables source ``name``'s import found its table reads (:func:`balancer.sources.tables.identities`)."""
    return list(conn.execute(sa.select(sources.c.relations).where(sources.c.name == name)).scalar() or [])


def read_cursor(conn: Connection, name: str) -> Cursor | None:
    row = conn.execute(sa.select(sources.c.position, sources.c.rescan).where(sources.c.name == name)).first()
    return None if row is None else Cursor(row.position, row.rescan)


def advance(conn: Connection, name: str, start: Cursor, end: Cursor, *, inserted: int, caught_up: bool) -> bool:
    """In the caller's transaction (the one inserting the batch's tasks): move the
    cursor from ``start`` to ``end``, only if it is still at ``start``. False: another
    ingester moved it first (the batch's tasks are then already present)."""
    def stored(value: str | None) -> Any:
        return sa.null() if value is None else sa.func.to_jsonb(sa.cast(value, sa.Text))

    def same(column: Any, value: str | None) -> Any:
        return column.is_(None) if value is None else column == stored(value)

    moved = conn.execute(
        sa.update(sources)
        .where(sources.c.name == name, same(sources.c.position, start.position), same(sources.c.rescan, start.rescan))
        .values(position=stored(end.position), rescan=stored(end.rescan), ingested=sources.c.ingested + inserted,
                read_at=sa.func.now(), **({"caught_up_at": sa.func.now()} if caught_up else {}))
    ).rowcount
    return bool(moved)

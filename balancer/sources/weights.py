"""Every source's share (weight) of the dispatch window, with its audit.

A source with no row has :data:`DEFAULT_WEIGHT`. Sources declared in a sources
file set theirs at import; any source, JSONL and inbox ones included, can be
set with ``balancer source set NAME --weight N``.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.engine import Connection

from balancer.sources.fairshare import MAX_WEIGHT
from balancer.storage import audit
from balancer.storage.schema import source_changes, source_weights

#: The weight of a source that has none set.
DEFAULT_WEIGHT = 1


def weights(conn: Connection) -> dict[str, int]:
    """Every source with a weight set, and its weight (others have :data:`DEFAULT_WEIGHT`)."""
    return {r.source: int(r.weight) for r in conn.execute(sa.select(source_weights.c.source, source_weights.c.weight))}


def set_weight(conn: Connection, source: str, weight: int, *, by: str) -> bool:
    """Set ``source``'s weight in the caller's transaction, audited; False if it was already that."""
    if not 1 <= weight <= MAX_WEIGHT:
        raise ValueError(f"a source's weight is a whole number from 1 to {MAX_WEIGHT}, not {weight}")
    old = conn.execute(sa.select(source_weights.c.weight).where(source_weights.c.source == source)).scalar()
    if old == weight:
        return False
    conn.execute(
        insert(source_weights).values(source=source, weight=weight)
        .on_conflict_do_update(index_elements=[source_weights.c.source],
                               set_={"weight": weight, "updated_at": sa.func.now()})
    )
    audit.record(conn, source_changes, source, by=by, action="weight",
                 old=None if old is None else {"weight": int(old)}, new={"weight": weight})
    return True

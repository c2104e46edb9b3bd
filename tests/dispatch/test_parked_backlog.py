"""Tasks no open model may take cost a dispatch round nothing: the rows the
round's queries read, from PostgreSQL's own counters, do not grow with them."""

from __future__ import annotations

import dataclasses

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.dispatch import fairness
from balancer.services import Services
from balancer.settings import Settings


def insert(conn: sa.Connection, count: int, allowed: list[str] | None) -> None:
    conn.execute(sa.text(
        "INSERT INTO tasks (source, prompt, allowed_models, max_tokens, estimated_tokens) "
        "SELECT 'test', 'prompt ' || g, CAST(:allowed AS text[]), 64, 100 FROM generate_series(1, :n) AS g"
    ), {"allowed": allowed, "n": count})


def rows_read(conn: sa.Connection) -> int:
    """Rows this transaction fetched from ``tasks`` by index or sequential scan."""
    return conn.execute(sa.text(
        "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) FROM pg_stat_xact_user_tables "
        "WHERE relid = CAST('tasks' AS regclass)"
    )).scalar_one()


@pytest.mark.parametrize("parked", [20_000])
def test_tasks_pinned_to_a_disabled_model_are_not_read(migrated, parked: int) -> None:
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("on", 4, 1_000_000), dataclasses.replace(Quota("off", 4, 1_000_000), enabled=False)])
    with svc.engine.begin() as conn:
        insert(conn, parked, ["off"])  # the oldest: first in priority-then-age order
        insert(conn, 30, ["on"])
        insert(conn, 30, None)
        insert(conn, 30, ["on", "off"])
    with svc.engine.connect() as conn:
        conn.execute(sa.text("ANALYZE tasks"))  # the statistics that see one model holding nearly every pinned task
        conn.commit()
    with svc.engine.begin() as conn:  # one round's reads, as the dispatcher makes them
        who = fairness.pending(svc, conn)
        window = fairness.claim_flexible(svc, conn, 16, {"on": 4}, who=who).tasks
        pinned, reserved = fairness.pinned_lane(conn, {"on": 4}, {"on": 4, "off": 4}, window, (), who)
        read = rows_read(conn)
    assert [t.allowed_models for t in pinned] == [("on",)] * 4
    assert reserved == {"on", "off"}
    assert len(window) == 16 and all(t.allowed_models is None or "on" in t.allowed_models for t in window)
    assert read < 500, f"{read} rows read for a round with {parked:,} tasks parked on a disabled model"

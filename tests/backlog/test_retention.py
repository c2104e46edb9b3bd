"""History: a scrape does not read it, and ``balancer tasks prune`` drops it (dry run first, audited)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.backlog.operations import operations
from balancer.cli import main
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks
from balancer.views.metrics import BalancerCollector


def add(svc: Services, count: int, status: str, age: timedelta) -> list[int]:
    with svc.engine.begin() as conn:
        return list(conn.execute(sa.text(
            "INSERT INTO tasks (source, prompt, status, max_tokens, estimated_tokens, updated_at) "
            "SELECT 'test', 'p' || g, :status, 64, 100, now() - make_interval(secs => :age) "
            "FROM generate_series(1, :n) AS g RETURNING id"
        ), {"status": status, "age": age.total_seconds(), "n": count}).scalars())


@pytest.fixture
def svc(migrated) -> Services:
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([Quota("a", 2, 50_000)])
    return services


def rows_read(conn: sa.Connection, statement: str, params: Any) -> int:
    """Rows the plan's scans read (returned or filtered out), from EXPLAIN ANALYZE."""
    plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params).scalar_one()[0]["Plan"]
    total, stack = 0, [plan]
    while stack:
        node = stack.pop()
        if "Scan" in node["Node Type"]:
            total += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get("Actual Loops", 1)
        stack.extend(node.get("Plans", []))
    return total


def test_a_scrape_does_not_read_the_history(svc: Services) -> None:
    """50,000 old solved tasks and 20 pending: a scrape's statements read tens
    of rows, not the history (before: every scrape counted the whole table)."""
    add(svc, 50_000, "solved", timedelta(days=2))
    add(svc, 20, "pending", timedelta(0))
    with svc.engine.connect() as conn:
        conn.execute(sa.text("ANALYZE tasks"))
        conn.commit()
    collector = BalancerCollector(svc)
    first = {s.labels.get("status"): s.value for m in collector.collect() if m.name == "balancer_tasks" for s in m.samples}
    assert first["solved"] == 50_000 and first["pending"] == 20
    statements: list[tuple[str, Any]] = []

    def capture(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        statements.append((statement, parameters))

    sa.event.listen(svc.engine, "before_cursor_execute", capture)
    try:
        second = {s.labels.get("status"): s.value for m in collector.collect() if m.name == "balancer_tasks"
                  for s in m.samples}
    finally:
        sa.event.remove(svc.engine, "before_cursor_execute", capture)
    assert second == first
    with svc.engine.connect() as conn:
        read = {" ".join(statement.split()[:8]): rows_read(conn, statement, params)
                for statement, params in statements if statement.lstrip().upper().startswith(("SELECT", "WITH"))}
    assert statements and sum(read.values()) < 1_000, [(n, s) for s, n in read.items() if n > 100]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prune_deletes_only_old_finished_tasks_dry_run_first_and_audited(
    svc: Services, capsys: pytest.CaptureFixture[str]
) -> None:
    old = {status: add(svc, 3, status, timedelta(days=10)) for status in ("solved", "failed", "cancelled",
                                                                         "pending", "queued", "running")}
    recent = add(svc, 2, "solved", timedelta(hours=1))
    cutoff = (datetime.now(UTC) - timedelta(days=1)).strftime("%Y-%m-%d %H:%M:%S")
    code, out, _ = run(capsys, "tasks", "prune", "--before", cutoff)
    assert code == 0 and "would delete 9 " in out
    with svc.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(tasks)).scalar_one() == 20
    assert operations(svc.engine) == []
    code, out, _ = run(capsys, "tasks", "prune", "--before", cutoff, "--yes", "--by", "ops")
    assert code == 0 and "deleted 9 " in out
    with svc.engine.connect() as conn:
        left = set(conn.execute(sa.select(tasks.c.id)).scalars())
    assert left == {*old["pending"], *old["queued"], *old["running"], *recent}
    [audit] = operations(svc.engine)
    assert audit["action"] == "prune" and audit["done_by"] == "ops"
    assert sorted(audit["task_ids"]) == sorted([*old["solved"], *old["failed"], *old["cancelled"]])
    code, _, err = run(capsys, "tasks", "prune", "--before", "soon")
    assert code == 2 and "Traceback" not in err

"""``status`` reads through its read-only snapshot (one psycopg2 transaction, no SQLAlchemy):
the same figures as the engine path that ``top``, the console and the metrics exporter read
through, on data that gives every one of its reads something to count; one snapshot for all of
them; and a database it cannot read is one line."""

from __future__ import annotations

import json
import time

import pytest
import sqlalchemy as sa

from balancer.cli import main


@pytest.fixture
def svc(migrated):  # noqa: ANN001, ANN201
    from balancer.services import Services
    from balancer.settings import Settings

    return Services.connect(Settings.from_env())


def backlog(svc) -> None:  # noqa: ANN001
    """Two models (one priced; one on its prior latency, with a task pinned to it), pending tasks of
    three sources, one of them over its budget and declared as a source table with write-backs
    waiting and refused; tasks solved (their calls in the ledger) inside and outside the ETA's
    minute; a task that took another's answer; a queued task past its deadline; beat seen."""
    from balancer.admission.quota import Quota
    from balancer.admission.values import UNITS, token_cap
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks
    from balancer.costs.budget import Budget
    from balancer.dispatch.beat_seen import mark_beat_seen
    from balancer.sources.budgets import set_budget

    svc.quotas.replace_all([Quota("m", 4, 10**9, price_per_million_input=1.0, price_per_million_output=2.0,
                                  currency="USD", expected_latency_s=2.0), Quota("n", 2, 10**9)])
    lines = [{"prompt": f"{source}-{i}", "source": source, "max_tokens": 50 + i}
             for source, count in (("crm", 30), ("web", 12), ("batch", 9)) for i in range(count)]
    lines += [{"prompt": f"pinned-{i}", "source": "web", "model": "n"} for i in range(5)]
    rows, errors = parse_tasks("\n".join(json.dumps(line) for line in lines), models={"m": 10**9, "n": 10**9})
    assert not errors
    with svc.engine.begin() as conn:
        ids = insert_tasks(conn, rows)
        solved = {"recent": ids[:6], "old": ids[6:10]}
        for when, at in (("recent", "now() - interval '10 seconds'"), ("old", "now() - interval '2 hours'")):
            conn.execute(sa.text("UPDATE tasks SET status = 'solved', model = 'm', prompt_tokens = 700, "  # noqa: S608
                                 f"completion_tokens = 30, created_at = now() - interval '3 hours', solved_at = {at}, "
                                 f"updated_at = {at} WHERE id = ANY(:ids)"), {"ids": solved[when]})
        conn.execute(sa.text("INSERT INTO call_usage (call_id, task_id, source, model, admission_id, prompt_tokens, "
                             "completion_tokens, answered, hedge, ended_at, cost, currency) SELECT 'c' || id, id, source, "
                             "'m', 'a' || id, 700, 30, true, false, updated_at, :cost, 'USD' FROM tasks WHERE id = ANY(:ids)"),
                     {"ids": ids[:10], "cost": (700 * 1.0 + 30 * 2.0) / 1e6})  # m's price, as a worker records it
        conn.execute(sa.text("UPDATE tasks SET status = 'solved', model = 'm', reused_from = :first, prompt_tokens = 0, "
                             "completion_tokens = 0 WHERE id = :id"), {"first": ids[0], "id": ids[10]})
        conn.execute(sa.text("UPDATE tasks SET status = 'queued', model = 'm', admission_id = 'gone', "
                             "deadline = now() - interval '1 minute' WHERE id = :id"), {"id": ids[11]})
        conn.execute(sa.text("UPDATE tasks SET status = 'failed', error = 'no' WHERE id = :id"), {"id": ids[12]})
        conn.execute(sa.text("INSERT INTO sources (name, definition, ingested) VALUES ('crm', '{}', 33)"))
        conn.execute(sa.text("INSERT INTO source_outbox (task_id, source, outcome, state, attempts, last_error) "
                             "VALUES (:a, 'crm', 'solved', 'waiting', 1, 'permission denied'), "
                             "(:b, 'crm', 'solved', 'conflict', 0, NULL)"),
                     {"a": ids[0], "b": ids[1]})
        set_budget(conn, Budget("crm", 0.0), by="test")  # 0: spent however the day turns
        set_budget(conn, Budget("web", None, 10**6), by="test")
    mark_beat_seen(svc.redis, svc.settings.namespace, 60.0)
    deadline = time.monotonic() + 10  # a new model's buckets fill within moments: read them full, as both reads will
    while any(live.tokens_available < token_cap(live.limits) / UNITS for live in svc.core.live().values()):
        assert time.monotonic() < deadline, "the buckets never filled"
        time.sleep(0.05)


def test_status_reads_the_same_on_its_snapshot_as_on_the_engine(svc) -> None:  # noqa: ANN001
    from balancer.cli.status import read_status, status_json
    from balancer.snapshot import open_snapshot

    backlog(svc)
    on_engine = status_json(read_status(svc))
    with open_snapshot(svc.settings) as snap:
        on_snapshot = status_json(read_status(snap))
    beat = on_engine.pop("beat_last_tick_s"), on_snapshot.pop("beat_last_tick_s")  # seconds since: read a moment apart
    assert beat[0] is not None and beat[1] == pytest.approx(beat[0], abs=1.0)
    assert on_snapshot == on_engine
    assert list(on_snapshot) == list(on_engine)  # the keys in the same order too
    # Every read had something to count, so a read that went wrong on either path shows above.
    assert (on_engine["pending"], on_engine["queued"], on_engine["solved"], on_engine["failed"]) == (43, 1, 11, 1)
    assert (on_engine["reused"], on_engine["overdue"], on_engine["waiting_on_budget"]) == (1, 1, 17)
    assert on_engine["eta_s"] and on_engine["eta_low_s"] and on_engine["eta_high_s"]
    assert on_engine["spend"]["by_model"] == {"m": pytest.approx(10 * (700 + 2 * 30) / 1e6)}
    assert on_engine["projected"]["by_model"]["m"] > 0 and on_engine["projected"]["unpriced_tokens"]["n"] > 0
    assert [s["name"] for s in on_engine["sources"]] == ["crm"]
    assert on_engine["sources"][0] | {"lag_s": None} == {
        "name": "crm", "pending": 17, "in_flight": 1, "solved": 11, "failed": 1, "cancelled": 0, "writebacks_waiting": 1,
        "conflicts": 1, "ingested": 33, "lag_s": None, "changed": 0, "not_tasks": {}, "unwritable": 0,
        "unwritable_error": None, "writebacks_failing": 1, "writebacks_failing_error": "permission denied"}
    assert [r["kind"] for r in on_engine["health"]["sources"]["crm"]] == ["over_budget", "writeback_failing"]
    assert {b["source"]: b["over"] for b in on_engine["budgets"]} == {"crm": True, "web": False}
    assert [m["name"] for m in on_engine["models"]] == ["m", "n"]


def test_the_snapshot_is_one_read_only_transaction(svc) -> None:  # noqa: ANN001
    """Every read sees the database as it was at the first: a task inserted meanwhile is in none of
    them; and nothing can be written through it."""
    import psycopg2

    from balancer.admission.quota import Quota
    from balancer.backlog.reads import backlog, status_counts
    from balancer.snapshot import open_snapshot

    svc.quotas.replace_all([Quota("m", 1, 1000)])
    with open_snapshot(svc.settings) as snap:
        assert status_counts(snap.db)["pending"] == 0
        with svc.engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO tasks (prompt, max_tokens, estimated_tokens) VALUES ('x', 1, 2)"))
        assert status_counts(svc.engine)["pending"] == 1  # committed
        assert status_counts(snap.db)["pending"] == 0 and backlog(snap.db).unfinished == 0  # not in the snapshot
        with pytest.raises(psycopg2.errors.ReadOnlySqlTransaction):
            snap.db.exec_driver_sql("DELETE FROM tasks", {})


def test_status_with_a_database_it_cannot_reach_is_one_line(migrated, monkeypatch, capsys) -> None:  # noqa: ANN001
    monkeypatch.setenv("BALANCER_DATABASE_URL", "postgresql://bob:hunter2@127.0.0.1:1/x")
    assert main(["status", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot reach PostgreSQL at postgresql://***@127.0.0.1:1/x")
    assert "hunter2" not in err


def test_a_read_past_the_statement_timeout_says_so_in_one_line(svc) -> None:  # noqa: ANN001
    """A database reached but too slow is not "cannot reach": the read's error names the timeout."""
    from balancer.errors import ServiceUnavailable
    from balancer.snapshot import open_snapshot

    with open_snapshot(svc.settings) as snap:
        snap.db.exec_driver_sql("SELECT set_config('statement_timeout', '10', true)", {})
        with pytest.raises(ServiceUnavailable, match="did not answer a read in time") as caught:
            snap.db.exec_driver_sql("SELECT pg_sleep(1)", {})
    assert "\n" not in str(caught.value) and "cannot reach" not in str(caught.value)


def test_a_role_or_database_the_server_lacks_is_one_line_that_says_what_to_create(
        migrated, monkeypatch, capsys) -> None:  # noqa: ANN001
    """A new user's first `db upgrade` against a server without the URL's role read
    'FATAL: role "***" does not exist' (the role masked with the user part) and nothing else."""
    from sqlalchemy.engine import make_url

    url = make_url(migrated["BALANCER_DATABASE_URL"])
    monkeypatch.setenv("BALANCER_DATABASE_URL", url.set(username="no_such_role_here").render_as_string(False))
    assert main(["status", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist: the URL's user is no role on that server: create it" in err, err
    monkeypatch.setenv("BALANCER_DATABASE_URL", url.set(database="no_such_database_here").render_as_string(False))
    assert main(["status", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and '"no_such_database_here" does not exist: create it (createdb' in err, err


def test_calls_in_flight_after_every_task_finished_are_named_as_such(svc, capsys) -> None:  # noqa: ANN001
    """A hedge's loser runs to its end after its task is answered: with no task left unfinished,
    ``status`` says the calls a model still shows belong to finished tasks, and stops saying so
    once they end."""
    from balancer.admission.core import Admitted, Candidate
    from balancer.admission.quota import Quota

    svc.quotas.replace_all([Quota("m", 4, 10**9)])
    with svc.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tasks (prompt, max_tokens, estimated_tokens, status, model) "
                             "VALUES ('a', 1, 2, 'solved', 'm'), ('b', 1, 2, 'solved', 'm')"))
    (loser,) = svc.core.admit([Candidate(2, ("m",))])
    assert isinstance(loser, Admitted)

    assert main(["status"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("eta: done; 1 call(s) of finished tasks still run at the backend "
                          "(a hedge's loser runs to its end; its slot frees then)"), first
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calls_after_the_end"] == 1

    with svc.engine.begin() as conn:  # a task unfinished: a call in flight may be its own
        conn.execute(sa.text("INSERT INTO tasks (prompt, max_tokens, estimated_tokens) VALUES ('c', 1, 2)"))
    assert main(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calls_after_the_end"] == 0
    with svc.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM tasks WHERE prompt = 'c'"))

    svc.core.finish(loser.admission_id)
    assert main(["status"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("eta: done")

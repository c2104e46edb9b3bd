"""``balancer quota ...`` against real Redis and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.admission.quota import Quota
from balancer.admission.values import Admitted, Candidate, NotNow, Settlement
from balancer.cli import main
from balancer.quotas.store import QuotaStore
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks

pytestmark = pytest.mark.usefixtures("migrated")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def services() -> Services:
    return Services.connect(Settings.from_env())


@pytest.mark.smoke
def test_set_list_and_audit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "quota", "list")  # none yet: how to add one, not an empty table
    assert code == 0 and out.startswith("no models yet: add one with `balancer quota set NAME --create")
    code, out, err = run(capsys, "quota", "set", "gpt-a", "--create", "--tpm", "6000", "--concurrency", "2", "--by", "alice")
    assert code == 0, err
    code, out, err = run(capsys, "quota", "set", "gpt-a", "--weight", "3", "--rpm", "60")
    assert code == 0, err
    code, out, _ = run(capsys, "quota", "list", "--json")
    rows = json.loads(out)
    assert rows[0]["name"] == "gpt-a" and rows[0]["weight"] == 3 and rows[0]["max_requests_per_minute"] == 60
    assert rows[0]["burst_tokens"] == 6000
    assert rows[0]["live"]["in_flight"] == 0
    history = services().quotas.history("gpt-a")
    assert [h["action"] for h in history] == ["create", "update"]
    assert history[0]["changed_by"] == "alice"
    assert history[1]["changed_by"]  # the OS user
    assert history[1]["old_value"]["weight"] == 1 and history[1]["new_value"]["weight"] == 3
    code, out, _ = run(capsys, "quota", "list")
    assert "gpt-a" in out and "0/2" in out


def test_quota_list_piped_cuts_no_value(capsys: pytest.CaptureFixture[str]) -> None:
    """Piped (no terminal to fit), the table is as wide as its cells: a new user's `quota list`
    showed values cut to "…" at 120 columns with a long model name and large limits."""
    name = "a-model-name-as-long-as-a-model-name-may-be-which-is-64-chars-xx"
    assert len(name) == 64
    code, _, err = run(capsys, "quota", "set", name, "--create", "--tpm", "1000000000", "--concurrency", "5000",
                       "--rpm", "1000000000")
    assert code == 0, err
    out = run(capsys, "quota", "list")[1]
    row = next(line for line in out.splitlines() if name in line)  # the name unbroken, on one line
    assert row.count("1,000,000,000") >= 2 and "0/5000" in row
    assert "…" not in out
    assert "when full, the burst less the tokens in transit (250 ms of TPM" in " ".join(out.split())  # the caption


def test_set_prints_what_changed_from_and_to_not_the_whole_quota(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "quota", "set", "gpt-b", "--create", "--tpm", "6000", "--concurrency", "2")
    assert code == 0 and out == "gpt-b: created: max_concurrent_requests 2, max_tokens_per_minute 6,000\n"
    code, out, _ = run(capsys, "quota", "set", "gpt-b", "--tpm", "9000", "--weight", "3")
    cleared = "; what it learned (limits, limit headers) and any token debt cleared\n"
    assert code == 0 and out == "gpt-b: updated: max_tokens_per_minute 6,000 → 9,000, weight 1 → 3" + cleared
    assert "{" not in out  # no JSON
    code, out, _ = run(capsys, "quota", "set", "gpt-b", "--tpm", "9000")
    assert code == 0 and out == "gpt-b: unchanged" + cleared


def test_a_price_change_keeps_what_the_model_learned(capsys: pytest.CaptureFixture[str]) -> None:
    """A price is for people (spend), not admission: changing it alone sends nothing to
    Redis, so the model's slow start and learned limits carry on (a quota change resets them)."""
    assert run(capsys, "quota", "set", "m", "--create", "--tpm", "600000", "--concurrency", "8")[0] == 0
    svc = services()
    admitted = [d for d in svc.core.admit([Candidate(10)] * 2) if isinstance(d, Admitted)]
    assert all(isinstance(svc.core.renew(a.admission_id, "m", 10), Admitted) for a in admitted)  # the ramp's clock starts
    began = svc.core.live()["m"].learned.ramp_at
    assert began
    assert run(capsys, "quota", "set", "m", "--price-input", "2.5", "--price-output", "10", "--currency", "USD")[0] == 0
    assert svc.core.live()["m"].learned.ramp_at == began
    assert run(capsys, "quota", "set", "m", "--weight", "2")[0] == 0          # a change Redis holds: a new slow start
    assert svc.core.live()["m"].learned.ramp_at == 0


def test_a_price_set_names_the_one_currency_so_export_reads_back(capsys: pytest.CaptureFixture[str],
                                                                  tmp_path: Path) -> None:
    """A quota file names one currency, at its top, for every price: ``quota set`` keeps to it, so
    ``quota export`` always reads back (a price set with no currency exported a file that import
    refused, and spend showed amounts with no currency). A price takes the currency the other
    models name; the first one names it."""
    assert run(capsys, "quota", "set", "a", "--create", "--tpm", "600", "--concurrency", "1")[0] == 0
    code, _, err = run(capsys, "quota", "set", "a", "--price-input", "2")
    assert code == 2 and err == "error: a has a price and no currency: name it once (three capital letters such as USD)\n"
    assert run(capsys, "quota", "set", "a", "--price-input", "2", "--currency", "USD")[0] == 0
    assert run(capsys, "quota", "set", "b", "--create", "--tpm", "600", "--concurrency", "1")[0] == 0
    code, _, err = run(capsys, "quota", "set", "b", "--price-output", "1", "--currency", "EUR")
    assert code == 2 and "a quota file names one currency" in err
    code, _, err = run(capsys, "quota", "set", "b", "--currency", "euro")
    assert code == 2 and "three capital letters" in err
    assert [(q.price_per_million_output, q.currency) for q in services().quotas.all()] == [(None, "USD"), (None, None)]
    code, out, _ = run(capsys, "quota", "set", "b", "--price-output", "1")  # the other model's currency
    assert code == 0 and "currency none → USD" in out
    exported = tmp_path / "q.toml"
    assert run(capsys, "quota", "export", str(exported))[0] == 0
    code, out, err = run(capsys, "quota", "import", str(exported), "--dry-run")
    assert code == 0 and "nothing changed" in out, err


def test_latency_prior_then_learned_latency_in_quota_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "quota", "set", "m", "--create", "--tpm", "600000", "--concurrency", "2",
               "--expected-latency", "4")[0] == 0
    rows = json.loads(run(capsys, "quota", "list", "--json")[1])
    assert rows[0]["expected_latency_s"] == 4.0
    assert rows[0]["latency_s"] == {"p50": 4.0, "p90": 7.6, "p99": 12.8, "samples": 0}  # the prior
    core = services().core
    for _ in range(8):
        admitted = core.admit([Candidate(10)])[0]
        assert isinstance(admitted, Admitted)
        core.finish(admitted.admission_id, Settlement(used_tokens=10, latency_ms=900, completion_tokens=5))
    rows = json.loads(run(capsys, "quota", "list", "--json")[1])
    learned = rows[0]["latency_s"]
    assert 0.9 <= learned["p50"] <= learned["p99"] < 1.1 and learned["samples"] > 7
    out = run(capsys, "quota", "list")[1]
    assert "prior" not in out and f"{learned['p50']:g} / {learned['p90']:g}" in out
    code, _, err = run(capsys, "quota", "set", "m", "--expected-latency", "nan")
    assert code == 2 and "expected_latency_s must be a number of seconds" in err and len(err.strip().splitlines()) == 1


def test_on_disconnect_defaults_to_continue_and_can_be_set(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "quota", "set", "m", "--create", "--tpm", "600000", "--concurrency", "2")[0] == 0
    assert json.loads(run(capsys, "quota", "list", "--json")[1])[0]["on_disconnect"] == "continue"
    assert run(capsys, "quota", "set", "m", "--on-disconnect", "stop")[0] == 0
    assert services().quotas.get("m").on_disconnect == "stop"
    assert services().core.live()["m"].quota.on_disconnect == "stop"  # the live state holds it too
    assert run(capsys, "quota", "set", "m", "--on-disconnect", "finish")[0] == 0  # the old name of continue
    assert services().quotas.get("m").on_disconnect == "continue"
    assert services().core.live()["m"].quota.on_disconnect == "continue"
    code, _, err = run(capsys, "quota", "set", "m", "--on-disconnect", "sometimes")
    assert code == 2 and "sometimes" in err


def test_removing_a_model_warns_of_tasks_pinned_to_it(capsys: pytest.CaptureFixture[str]) -> None:
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import parse_tasks

    for name in ("a", "b"):
        assert run(capsys, "quota", "set", name, "--create", "--tpm", "60000", "--concurrency", "2")[0] == 0
    lines = [{"prompt": "x", "model": "b"}, {"prompt": "y", "models": ["a", "b"]}, {"prompt": "z"}]
    rows, errors = parse_tasks("\n".join(json.dumps(line) for line in lines), models={"a": 60_000, "b": 60_000})
    assert not errors
    with services().engine.begin() as conn:
        insert_tasks(conn, rows)
    code, out, err = run(capsys, "quota", "remove", "b")
    assert code == 2 and err.strip() == (
        "error: b has 0 call(s) in flight or bound to it (ready, queued or running) and 1 pending task(s) that "
        "only it may take; "
        "remove it with --force to fail those tasks")
    assert "b" in services().core.live()  # refused before the commit: Redis untouched too
    code, out, err = run(capsys, "quota", "remove", "b", "--force")
    assert code == 0 and "b: removed; 1 pending task(s) only it could take failed" in out and err == ""
    code, out, err = run(capsys, "quota", "remove", "a")  # the task allowed on a or b is a's alone now
    assert code == 2 and "1 pending task(s) that only it may take" in err
    assert run(capsys, "quota", "remove", "a", "--force")[0] == 0
    with services().engine.connect() as conn:
        rows = conn.execute(sa.select(tasks.c.prompt, tasks.c.status, tasks.c.error).order_by(tasks.c.id)).all()
    assert [(r.prompt, r.status) for r in rows] == [("x", "failed"), ("y", "failed"), ("z", "pending")]
    assert rows[0].error == "model b was removed (quota remove --force)"
    # Retried, they are pending again for models that are gone: said, as a removal says it (before: nothing).
    assert run(capsys, "quota", "set", "c", "--create", "--tpm", "60000", "--concurrency", "2")[0] == 0
    code, out, err = run(capsys, "tasks", "retry", "--yes")
    assert code == 0 and "retried 2 task(s)" in out
    assert err.strip() == ("warning: 2 pending task(s) may only run on models that no longer exist; "
                           "they wait until one of those models is added again")
    # status counts them apart from the ETA, which is a number for the rest (it was unknown).
    code, out, _ = run(capsys, "status", "--json")
    reported = json.loads(out)
    assert code == 0 and reported["waiting_on_no_model"] == 2 and reported["eta_s"] is not None
    code, out, _ = run(capsys, "status")
    assert "2 pending task(s) may take only models removed, disabled or stopped (health), not in the eta" in out


def test_remove_refuses_a_model_with_calls_in_flight(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "quota", "set", "a", "--create", "--tpm", "60000", "--concurrency", "2")[0] == 0
    call = services().core.admit([Candidate(10)])[0]
    assert isinstance(call, Admitted)  # a router call: in Redis only
    code, _, err = run(capsys, "quota", "remove", "a")
    assert code == 2 and "a has 1 call(s) in flight or bound to it" in err
    assert run(capsys, "quota", "remove", "a", "--force")[0] == 0


@pytest.mark.smoke
def test_live_change_applies_to_the_very_next_admission(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "quota", "set", "m", "--create", "--tpm", "600000", "--concurrency", "2")[0] == 0
    core = services().core
    assert isinstance(core.admit([Candidate(10)])[0], Admitted)
    assert run(capsys, "quota", "set", "m", "--concurrency", "1")[0] == 0
    assert isinstance(core.admit([Candidate(10)])[0], NotNow)
    assert run(capsys, "quota", "set", "m", "--concurrency", "5")[0] == 0
    assert isinstance(core.admit([Candidate(10)])[0], Admitted)
    assert run(capsys, "quota", "set", "m", "--disable")[0] == 0
    decision = core.admit([Candidate(10)])[0]
    assert isinstance(decision, NotNow) and decision.retry_at_ms is None
    assert run(capsys, "quota", "set", "m", "--enable", "--tpm", "60", "--burst", "5")[0] == 0
    decision = core.admit([Candidate(10)])[0]
    assert "burst_tokens (5)" in decision.reason  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["quota", "set", "ghost", "--tpm", "5"], "unknown model 'ghost'"),
        (["quota", "set", "m", "--tpm", "0"], "--tpm"),
        (["quota", "set", "m", "--tpm", "-3"], "--tpm"),
        (["quota", "set", "m", "--concurrency", "2.5"], "--concurrency"),
        (["quota", "set", "m", "--concurrency", "1000000000"], "--concurrency': 1000000000 is not in the range 1<=x<=100000"),
        (["quota", "set", "gpt\x1b[31m", "--tpm", "5"], "invalid model name"),
        (["quota", "set", "m", "--burst", "0"], "--burst"),
        (["quota", "set", "m", "--weight", "x"], "--weight"),
        (["quota", "set", "m"], "nothing to change"),
        (["quota", "set", "new", "--create", "--tpm", "5"], "needs --concurrency"),
        (["quota", "set", "bad name!", "--create", "--tpm", "5", "--concurrency", "1"], "invalid model name"),
        (["quota", "remove", "ghost"], "unknown model 'ghost'"),
        (["quota", "nope"], "No such command"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_changed(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert run(capsys, "quota", "set", "m", "--create", "--tpm", "100", "--concurrency", "1")[0] == 0
    before = services().quotas.all(), len(services().quotas.history())
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert "Traceback" not in err
    assert (services().quotas.all(), len(services().quotas.history())) == before


@pytest.mark.smoke
def test_export_import_round_trip(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "in.toml"
    source.write_text(
        '[models."gpt.4o-mini"]\nmax_concurrent_requests = 8\nmax_tokens_per_minute = 120000\nweight = 2\n'
        "max_requests_per_minute = 600\nburst_tokens = 30000\n\n"
        "[models.small]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\nenabled = false\n"
    )
    assert run(capsys, "quota", "set", "stale", "--create", "--tpm", "1", "--concurrency", "1")[0] == 0
    code, _, err = run(capsys, "quota", "import", str(source))
    assert code == 2 and "would remove 1 model(s) (stale)" in err and "--replace" in err
    assert [q.name for q in services().quotas.all()] == ["stale"]  # refused: nothing changed
    code, out, _ = run(capsys, "quota", "import", str(source), "--dry-run")
    assert code == 0 and "would remove stale" in out and "would create small" in out and "nothing changed" in out
    assert out.endswith("without --replace this import is refused: it would remove 1\n")  # as the import above was
    assert [q.name for q in services().quotas.all()] == ["stale"]
    code, out, _ = run(capsys, "quota", "import", str(source), "--dry-run", "--replace")
    assert code == 0 and "would remove stale" in out and "refused" not in out
    code, out, err = run(capsys, "quota", "import", str(source), "--replace")
    assert code == 0, err
    assert "2 created" in out and "1 removed" in out
    exported = tmp_path / "out.toml"
    assert run(capsys, "quota", "export", str(exported))[0] == 0
    changed = tmp_path / "changed.toml"  # a dry run names what an update changes (it named the model only)
    changed.write_text(exported.read_text().replace("max_tokens_per_minute = 120000", "max_tokens_per_minute = 90000"))
    code, out, _ = run(capsys, "quota", "import", str(changed), "--dry-run")
    assert code == 0 and "would update gpt.4o-mini: max_tokens_per_minute 120,000 → 90,000\n" in out, out
    assert run(capsys, "quota", "import", str(exported))[0] == 0
    code, again, _ = run(capsys, "quota", "export")
    assert again == exported.read_text()
    names = [q.name for q in services().quotas.all()]
    assert names == ["gpt.4o-mini", "small"]
    live = services().core.live()
    assert set(live) == {"gpt.4o-mini", "small"} and live["small"].quota.enabled is False


@pytest.mark.parametrize(
    "text, message",
    [
        ("[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = \n", "line 3"),
        ("[models.a]\nmax_concurrent_requests = 0\nmax_tokens_per_minute = 5\n", "line 2"),
        ("[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\nburst_tokens = 0\n", "line 4"),
        ("[models.a]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\ncolour = 'red'\n", "colour"),
        ("[models.a]\nmax_tokens_per_minute = 5\n", "max_concurrent_requests"),
        ('[models."a b"]\nmax_concurrent_requests = 1\nmax_tokens_per_minute = 5\n', "line 1"),
    ],
)
def test_malformed_import_changes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str
) -> None:
    assert run(capsys, "quota", "set", "keep", "--create", "--tpm", "9", "--concurrency", "1")[0] == 0
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    code, _, err = run(capsys, "quota", "import", str(bad))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert [q.name for q in services().quotas.all()] == ["keep"]


@pytest.mark.parametrize("content", [b"", b"[models]\n", b"# nothing\n", b"\xff\xfe[models.a]\n"])
def test_an_empty_or_unreadable_import_changes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes
) -> None:
    assert run(capsys, "quota", "set", "keep", "--create", "--tpm", "9", "--concurrency", "1")[0] == 0
    bad = tmp_path / "bad.toml"
    bad.write_bytes(content)
    for argv in (["quota", "import", str(bad)], ["quota", "import", str(bad), "--replace"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert [q.name for q in services().quotas.all()] == ["keep"]
    code, _, err = run(capsys, "quota", "export", str(tmp_path / "missing" / "out.toml"))
    assert code == 2 and "cannot write" in err


def test_unreachable_services_name_masked_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, migrated: dict[str, str]
) -> None:
    monkeypatch.setenv("BALANCER_REDIS_URL", "redis://:hunter2@127.0.0.1:1/0")
    code, _, err = run(capsys, "quota", "list")
    assert code == 2 and "redis://***@127.0.0.1:1/0" in err and "hunter2" not in err
    # Put Redis back (not monkeypatch.undo(): that would also drop the test's own
    # URLs and send the CLI to the persistent embedded stack).
    monkeypatch.setenv("BALANCER_REDIS_URL", migrated["BALANCER_REDIS_URL"])
    monkeypatch.setenv("BALANCER_DATABASE_URL", "postgresql://bob:hunter2@127.0.0.1:1/x")
    code, _, err = run(capsys, "quota", "list")
    assert code == 2 and "://***@127.0.0.1:1" in err and "bob" not in err and "hunter2" not in err
    assert len(err.strip().splitlines()) == 1


def test_unmigrated_database_is_one_line(capsys: pytest.CaptureFixture[str], database_url: str) -> None:
    import sqlalchemy as sa

    with sa.create_engine(database_url).begin() as conn:
        conn.execute(sa.text("DELETE FROM alembic_version"))
    code, _, err = run(capsys, "quota", "list")
    assert code == 2 and "balancer db upgrade" in err


def test_a_failed_push_is_stored_and_the_sweep_repairs_it(database_url: str) -> None:
    """PostgreSQL first: a change Redis refuses is still stored (and says so), and
    the drift repair that every sweep tick runs makes Redis match it."""
    from balancer.quotas.store import LiveNotUpdated
    from balancer.storage.db import cached_engine

    class BrokenLive:
        def apply_quotas(self, changes: object) -> None:
            raise ConnectionError("redis went away")

        def live_quotas(self) -> dict[str, Quota]:
            raise ConnectionError("redis went away")

        def restore(self) -> bool:
            raise ConnectionError("redis went away")

    svc = services()
    svc.core.restore()  # a running deployment: the live state is there
    store = QuotaStore(cached_engine(database_url), live=BrokenLive())
    with pytest.raises(LiveNotUpdated, match="stored, but the live state was not updated"):
        store.set("m", {"max_concurrent_requests": 1, "max_tokens_per_minute": 5}, create=True)
    assert [q.name for q in store.all()] == ["m"] and len(store.history()) == 1
    assert "m" not in svc.core.live()
    assert svc.quotas.repair_drift() == ["m"]
    assert svc.core.live()["m"].quota.max_tokens_per_minute == 5
    assert svc.quotas.repair_drift() == []  # in step: nothing to do
    svc.core.set_quota(Quota("m", 7, 5))  # a change that bypassed PostgreSQL
    svc.core.set_quota(Quota("ghost", 1, 5))
    assert svc.quotas.repair_drift() == ["ghost", "m"]
    assert set(svc.core.live()) == {"m"} and svc.core.live()["m"].quota.max_concurrent_requests == 1


@pytest.mark.smoke
def test_redis_data_loss_restores_from_postgres(capsys: pytest.CaptureFixture[str], redis_client, namespace: str) -> None:
    from tests.twin import delete_keys

    assert run(capsys, "quota", "set", "m", "--create", "--tpm", "60000", "--concurrency", "3", "--weight", "2")[0] == 0
    core = services().core
    assert isinstance(core.admit([Candidate(10)])[0], Admitted)
    delete_keys(redis_client, namespace)  # Redis restarted without persistence
    assert not core.is_loaded()
    decision = core.admit([Candidate(30_000)])[0]  # no manual step
    assert core.is_loaded()
    live = core.live()["m"]
    assert live.quota == Quota("m", 3, 60000, weight=2, burst_tokens=60000)
    # Buckets restart empty (conservative), so the first admission waits for refill: 30,000 tokens
    # at 1,000 a second, less what refilled since the restore (a few ms, or more on a loaded machine;
    # a 10-token call was admitted once 10 ms had passed between the restore and its admission).
    assert isinstance(decision, NotNow) and decision.wait_ms is not None and 25_000 <= decision.wait_ms <= 30_000


@pytest.mark.smoke
def test_console_script_runs(migrated: dict[str, str]) -> None:
    """The installed `balancer` entry point, as a user runs it."""
    env = {**os.environ, **migrated}
    proc = subprocess.run(
        [sys.executable, "-m", "balancer", "quota", "set", "m", "--tpm", "1"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    # What adding it takes, in one line: not one missing flag per try.
    assert proc.returncode == 2 and proc.stderr.strip() == "error: unknown model 'm': add it with --create and --concurrency"


def test_status_and_top_show_every_model_with_its_cap(capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    for name, cap in (("a", "2"), ("b", "5")):
        assert run(capsys, "quota", "set", name, "--create", "--tpm", "600000", "--concurrency", cap)[0] == 0
    core = services().core
    held = [core.admit([Candidate(10, ("a",))])[0] for _ in range(2)]
    assert all(isinstance(d, Admitted) for d in held)
    code, out, _ = run(capsys, "status", "--json")
    models = {m["name"]: m for m in json.loads(out)["models"]}
    assert (models["a"]["in_flight"], models["a"]["cap"], models["a"]["binding"]) == (2, 2, "concurrency")
    assert (models["b"]["in_flight"], models["b"]["cap"], models["b"]["binding"]) == (0, 5, "none")
    # An idle bucket is full at its capacity, the burst less the tokens in transit: shown against
    # that, not against the burst it never reaches (a new user read 9,833/10,000 as "never refills").
    code, out, _ = run(capsys, "quota", "list", "--json")
    b = next(r for r in json.loads(out) if r["name"] == "b")
    assert b["live"]["tokens_available"] == b["live"]["token_capacity"] < b["burst_tokens"]
    full = f"{b['live']['token_capacity']:,.0f}"
    assert models["b"]["bucket"] == b["live"]["token_capacity"]
    code, out, _ = run(capsys, "status")
    assert code == 0 and "2/2" in out and "0/5" in out and "concurrency" in out
    assert f"{full} / {full}" in out
    assert "beat: not seen lately; a running dispatcher" in out and "`balancer run`" in out  # none runs here
    done = subprocess.run([sys.executable, "-m", "balancer", "top", "--count", "2", "--interval", "0.1"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                          env={**os.environ, "COLUMNS": "160"})  # a wide terminal: every column, numbers in full
    assert done.returncode == 0, done.stderr
    assert "2/2" in done.stdout and "0/5" in done.stdout and "600,000" in done.stdout
    assert "pending: 0" in done.stdout


def test_top_piped_prints_each_refresh_as_it_comes(capsys: pytest.CaptureFixture[str]) -> None:
    """A new user's probe: `balancer top` with its output piped printed nothing until it was stopped
    (the live view draws only on a terminal). Piped, each refresh is printed after the last, whole
    lines, as `top -b` does. Ctrl-C, the way it ends, exits 0 without a word (it said "aborted")."""
    import queue
    import signal
    import threading
    import time

    assert run(capsys, "quota", "set", "a", "--create", "--tpm", "600000", "--concurrency", "2")[0] == 0
    top = subprocess.Popen([sys.executable, "-m", "balancer", "top", "--interval", "0.1"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert top.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in top.stdout], daemon=True).start()  # type: ignore[union-attr]
    frames, deadline = 0, time.monotonic() + 60
    try:
        while frames < 3 and time.monotonic() < deadline:  # no --count: it runs until stopped, printing as it goes
            with contextlib.suppress(queue.Empty):
                frames += "eta:" in lines.get(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        top.send_signal(signal.SIGINT)
        top.wait(timeout=30)
    assert frames == 3
    assert top.returncode == 0 and top.stderr is not None and top.stderr.read() == ""


def test_top_fits_100_columns_with_one_line_per_model_and_names_the_burst(capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    for name in ("gpt-4o-mini-2024-07-18", "claude-3-5-haiku-20241022", "local-llama-3.1-8b"):
        assert run(capsys, "quota", "set", name, "--create", "--tpm", "2000000", "--rpm", "10000",
                   "--concurrency", "400")[0] == 0
    done = subprocess.run([sys.executable, "-m", "balancer", "top", "--count", "1"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, "\n".join(lines)
    for name in ("gpt-4o-mini-2024-07-18", "claude-3-5-haiku-20241022", "local-llama-3.1-8b"):
        (row,) = [line for line in lines if name in line]  # one line: no cell wrapped
        assert "0 / 2M+2M" in row and "0 / 10k+10k" in row, row  # each rate against its TPM/RPM plus the burst
    assert any("/ TPM+burst" in line for line in lines) and any("/ RPM+burst" in line for line in lines)


def test_a_window_cap_is_set_audited_exported_and_enforced(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Issue 41 deliverable 3: ``--window-cap`` is stored, audited, pushed to the live state and round-trips
    through the quotas file; a burst above the rate under a cap is one line, exit 2, nothing changed."""
    code, out, err = run(capsys, "quota", "set", "w", "--create", "--tpm", "3000", "--concurrency", "8", "--window-cap")
    assert code == 0 and "window_cap true" in out, err
    history = services().quotas.history("w")
    assert history[-1]["new_value"]["window_cap"] is True
    live = services().core.live()["w"]
    assert live.quota.window_cap
    core = services().core
    assert isinstance(core.admit([Candidate(3_000, ("w",))])[0], Admitted)
    assert isinstance(core.admit([Candidate(1, ("w",))])[0], NotNow)  # the window is full for 60 s
    code, _, err = run(capsys, "quota", "set", "w", "--burst", "4000")
    assert code == 2 and err.count("\n") == 1 and "burst_tokens 4,000 is above max_tokens_per_minute 3,000" in err
    assert services().quotas.get("w").burst_tokens is None  # nothing changed
    exported = tmp_path / "q.toml"
    assert run(capsys, "quota", "export", str(exported))[0] == 0
    assert "window_cap = true" in exported.read_text()
    code, out, _ = run(capsys, "quota", "list")
    assert code == 0 and "3,000 window cap" in out
    code, out, _ = run(capsys, "quota", "set", "w", "--no-window-cap")
    assert code == 0 and out.startswith("w: updated: window_cap true → false")
    assert services().quotas.history("w")[-1]["old_value"]["window_cap"] is True
    assert run(capsys, "quota", "import", str(exported))[0] == 0
    assert services().quotas.get("w").window_cap and services().core.live()["w"].quota.window_cap


def test_displays_show_a_window_cap_as_such_and_the_burst_otherwise(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41 deliverable 3: status, top (wide and narrow) and the metrics show a capped model's rate
    against its TPM named "window cap", and the others' against the TPM plus the burst, named as such."""
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from balancer.views.metrics import BalancerCollector

    assert run(capsys, "quota", "set", "capped", "--create", "--tpm", "30000", "--rpm", "60", "--concurrency", "4",
               "--window-cap")[0] == 0
    assert run(capsys, "quota", "set", "bursty", "--create", "--tpm", "30000", "--rpm", "60", "--concurrency", "4")[0] == 0
    code, out, _ = run(capsys, "status", "--json")
    models = {m["name"]: m for m in json.loads(out)["models"]}
    assert models["capped"]["window_cap"] is True and models["bursty"]["window_cap"] is False
    for columns, capped_cells, bursty_cells in (("160", ("0 / 30,000 window cap", "0 / 60 window cap"),
                                                 ("0 / 30,000 + 30,000 burst", "0 / 60 + 60 burst")),
                                                ("100", ("0 / 30k cap", "0 / 60 cap"), ("0 / 30k+30k", "0 / 60+60"))):
        done = subprocess.run([sys.executable, "-m", "balancer", "top", "--count", "1"], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=120, env={**os.environ, "COLUMNS": columns})
        assert done.returncode == 0, done.stderr
        (capped,) = [line for line in done.stdout.splitlines() if "capped" in line]
        (bursty,) = [line for line in done.stdout.splitlines() if "bursty" in line]
        assert all(cell in capped for cell in capped_cells), capped
        assert all(cell in bursty for cell in bursty_cells) and "cap" not in bursty.replace("capped", ""), bursty
    registry = CollectorRegistry()
    registry.register(BalancerCollector(services(), finished_every=0))
    samples = {(s.name, s.labels.get("model")): s.value
               for family in text_string_to_metric_families(generate_latest(registry).decode()) for s in family.samples}
    assert samples[("balancer_model_window_cap", "capped")] == 1 and samples[("balancer_model_window_cap", "bursty")] == 0
    assert samples[("balancer_model_tokens_per_60s_allowed", "capped")] == 30_000
    assert samples[("balancer_model_tokens_per_60s_allowed", "bursty")] == 60_000
    assert samples[("balancer_model_requests_per_60s_allowed", "capped")] == 60
    assert samples[("balancer_model_requests_per_60s_allowed", "bursty")] == 120


@pytest.mark.parametrize("all_models", [False, True])
def test_a_worker_waiting_for_a_removed_quota_is_not_told_it_never_had_one_when_it_comes_back(
        monkeypatch: pytest.MonkeyPatch, all_models: bool) -> None:
    """A worker's start check reads the quotas and the removals. A quota re-created between
    the two reads must read as "removed, wait" or as back, never as a name that never had a
    quota (before: "unknown model(s): m", exit 2, as `quota set m --create` ran; seen under
    load in tests/cli/test_start_wait.py)."""
    from balancer.cli.processes import _worker_quotas
    from balancer.errors import QuotaRemoved

    svc = services()
    svc.quotas.replace_all([Quota("m", 2, 60_000)], by="test")
    svc.quotas.remove("m", by="test")
    store, reads = svc.quotas, []

    def then_recreated(read):  # noqa: ANN001, ANN202 - the first read of the check, then `quota set m --create`
        def reading(*args):  # noqa: ANN002, ANN202
            result = read(*args)
            reads.append(read.__name__)
            if len(reads) == 1:
                store.set("m", {"max_concurrent_requests": 2, "max_tokens_per_minute": 60_000}, create=True, by="test")
            return result
        return reading

    monkeypatch.setattr(store, "all", then_recreated(store.all))
    monkeypatch.setattr(store, "removed", then_recreated(store.removed))
    try:
        known = _worker_quotas(svc, () if all_models else ("m",), all_models)
    except QuotaRemoved:
        known = {}  # waits, and finds it at its next attempt
    assert set(reads) == {"all", "removed"}
    assert known in ({}, {"m": store.get("m")}) and store.get("m") is not None

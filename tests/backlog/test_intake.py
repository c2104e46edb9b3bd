"""``balancer submit`` and the JSONL parser behind it (and behind the inbox)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from balancer.admission.quota import Quota
from balancer.backlog.intake import jsonl_lines, parse_tasks
from balancer.backlog.reads import status_counts
from balancer.cli import main
from balancer.services import Services
from balancer.settings import Settings

MODELS = {"a": 2_000, "b": 50_000}


def test_parser_reports_each_bad_line_with_its_number() -> None:
    text = "\n".join([
        '{"prompt": "fine"}',
        "{not json",
        '{"priority": 1}',
        '{"prompt": ""}',
        '{"prompt": 7}',
        '{"prompt": "x", "model": "ghost"}',
        '{"prompt": "x", "priority": "high"}',
        '{"prompt": "x", "priority": 1.5}',
        '{"prompt": "' + "w" * 400_000 + '"}',
        '{"prompt": "x", "model": "a", "max_tokens": 3000}',
        "",
        '{"prompt": "ok too", "models": ["a", "b"], "priority": -3, "source": "crm"}',
        "[1, 2]",
    ])
    rows, errors = parse_tasks(text, models=MODELS)
    assert [r.prompt for r in rows] == ["fine", "ok too"]
    assert rows[1].allowed_models == ("a", "b") and rows[1].priority == -3 and rows[1].source == "crm"
    messages = {e.line: e.message for e in errors}
    assert sorted(messages) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 13]
    assert "invalid JSON" in messages[2] and messages[3] == "missing prompt" and messages[4] == "empty prompt"
    assert "string" in messages[5] and "ghost" in messages[6] and "integer" in messages[7] and "integer" in messages[8]
    assert "burst_tokens (50000)" in messages[9] and "burst_tokens (2000)" in messages[10]


# Input generation shares the CPU with the other test processes: its speed says nothing of the parser's.
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=500))
def test_parser_never_raises(text: str) -> None:
    """Any text parses into rows and line errors; numbers point at real lines (JSONL lines: split on \\n)."""
    rows, errors = parse_tasks(text, models=MODELS)
    lines = jsonl_lines(text)
    assert all(1 <= e.line <= len(lines) and lines[e.line - 1].strip() for e in errors)
    assert len(rows) + len(errors) == sum(1 for line in lines if line.strip())


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(st.text(max_size=30), st.integers(), st.none()),
    "priority": st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.booleans()),
    "model": st.one_of(st.sampled_from(["a", "b", "zz"]), st.integers()),
    "max_tokens": st.one_of(st.integers(-5, 3000), st.text(max_size=3)),
}), max_size=20))
def test_parser_fuzz_structured(lines: list[dict]) -> None:
    rows, errors = parse_tasks("\n".join(json.dumps(x) for x in lines), models=MODELS)
    assert len(rows) + len(errors) == len(lines)
    for row in rows:
        assert row.prompt.strip() and row.estimated_tokens <= max(MODELS.values())


@pytest.fixture
def quotas(migrated) -> Services:
    svc = Services.connect(Settings.from_env())
    svc.quotas.replace_all([Quota("a", 2, 2_000), Quota("b", 2, 50_000)])
    return svc


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.smoke
def test_submit_exit_codes_and_atomicity(quotas: Services, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "one"}\n{"prompt": "two", "model": "b"}\n')
    assert run(capsys, "submit", str(good))[0] == 0
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "three"}\n{"prompt": 3}\n{"prompt": "x", "model": "nope"}\n')
    code, out, err = run(capsys, "submit", str(mixed), "--strict")
    assert code == 2 and "mixed.jsonl:line 2" in err and "mixed.jsonl:line 3" in err and "nothing accepted" in err
    assert status_counts(quotas.engine)["pending"] == 2  # --strict wrote nothing
    code, out, err = run(capsys, "submit", str(mixed))
    assert code == 3 and "accepted 1 task(s), rejected 2 line(s)" in out
    assert status_counts(quotas.engine)["pending"] == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nonsense\n")
    code, _, err = run(capsys, "submit", str(bad))
    assert code == 2 and "no valid tasks" in err
    code, _, err = run(capsys, "submit", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "cannot read" in err and len(err.strip().splitlines()) == 1


def test_inbox_file_is_ingested_once_even_with_two_ingesters(quotas: Services, tmp_path: Path) -> None:
    from balancer.sources.inbox import ingest_inbox

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "batch1.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(25)) + "oops\n")
    past = time.time() - 10
    import os

    os.utime(inbox / "batch1.jsonl", (past, past))
    results: list = []
    barrier = threading.Barrier(2)

    def ingest() -> None:
        svc = Services.connect(Settings.from_env())
        barrier.wait()
        results.extend(ingest_inbox(svc, inbox))

    threads = [threading.Thread(target=ingest) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert status_counts(quotas.engine)["pending"] == 25
    assert sum(r.tasks for r in results) == 25
    assert (inbox / "done" / "batch1.jsonl").exists() and "line 26" in (inbox / "done" / "batch1.jsonl.errors").read_text()
    # The same file dropped again is recognised and not ingested twice.
    (inbox / "done" / "batch1.jsonl").rename(inbox / "batch1.jsonl")
    os.utime(inbox / "batch1.jsonl", (past, past))
    again = ingest_inbox(Services.connect(Settings.from_env()), inbox)
    assert again[0].duplicate and status_counts(quotas.engine)["pending"] == 25


HOSTILE_LINES = [  # (line, what the error says)
    ('{"prompt": "x", "source": "crm\\u0000"}', "source contains a NUL"),
    ('{"prompt": "half \\ud800 a pair"}', "prompt is not valid UTF-8"),
    ('{"prompt": "x", "models": ' + "[" * 5000 + "]" * 5000 + "}", "nested deeper"),
    ('{"prompt": "' + "w" * (4 * 1024 * 1024) + '"}', "line longer than"),
    ('{"prompt": "bad byte \udcff here"}', "prompt is not valid UTF-8"),  # 0xff read with surrogateescape
    ('\udcff\udcfe{"prompt": "x"}', "not UTF-8: byte 0xFF at column 1"),  # a UTF-16 file's BOM, read as UTF-8
    ('{"prompt": \udce9"x"}', "not UTF-8: byte 0xE9 at column 12"),  # a Latin-1 byte where JSON expects a value
    ('{"prompt": "x", "model": "gpt\\u001b[31m-red"}', "unknown model(s): gpt\\x1b[31m-red"),
]


def test_hostile_lines_are_errors_of_their_own_lines_and_cost_no_good_line() -> None:
    """Each hostile line is reported with its number and reason; the good lines
    around it (with raw U+2028, U+2029 and U+0085 inside their strings, CRLF
    endings and a BOM) are all accepted, and numbered right."""
    good = ['{"prompt": "para\u2028graph"}', '{"prompt": "next\u2029line"}', '{"prompt": "nel\x85here"}']
    lines = [good[0], *(line for line, _ in HOSTILE_LINES), good[1], good[2]]
    rows, errors = parse_tasks("\ufeff" + "\r\n".join(lines) + "\r\n", models=MODELS)
    assert [r.prompt for r in rows] == ["para\u2028graph", "next\u2029line", "nel\x85here"]
    assert [e.line for e in errors] == list(range(2, 2 + len(HOSTILE_LINES)))
    for error, (_, reason) in zip(errors, HOSTILE_LINES, strict=True):
        assert reason in error.message and "\x1b" not in error.message


def test_submit_accepts_the_good_lines_of_a_hostile_file(
    quotas: Services, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostile = tmp_path / "hostile.jsonl"
    body = "\n".join(['{"prompt": "good one"}', *(line for line, _ in HOSTILE_LINES), '{"prompt": "good two"}'])
    hostile.write_bytes(b"\xef\xbb\xbf" + body.encode("utf-8", "surrogateescape") + b"\n")
    code, out, err = run(capsys, "submit", str(hostile))
    assert code == 3, err
    assert f"accepted 2 task(s), rejected {len(HOSTILE_LINES)} line(s)" in out
    assert "Traceback" not in err and "\x1b" not in err
    assert status_counts(quotas.engine)["pending"] == 2


def test_a_poison_inbox_file_is_quarantined_and_never_blocks_the_others(quotas: Services, tmp_path: Path) -> None:
    """"a.jsonl" cannot be read at all (it is a directory), "b.jsonl" is all
    hostile lines but two, "c.jsonl" is fine: b and c are ingested, a is moved to
    rejected/ with its report, and a file of the same name already in done/ is
    never overwritten."""
    import os

    from balancer.sources.inbox import ingest_inbox

    inbox = tmp_path / "inbox"
    (inbox / "a.jsonl").mkdir(parents=True)
    hostile = "\n".join(['{"prompt": "b1"}', *(line for line, _ in HOSTILE_LINES), '{"prompt": "b2"}'])
    (inbox / "b.jsonl").write_bytes(hostile.encode("utf-8", "surrogateescape"))
    (inbox / "c.jsonl").write_text('{"prompt": "c1"}\n')
    (inbox / "done").mkdir()
    (inbox / "done" / "c.jsonl").write_text("an older file of the same name\n")
    past = time.time() - 10
    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        os.utime(inbox / name, (past, past))
    results = {r.name: r for r in ingest_inbox(Services.connect(Settings.from_env()), inbox)}
    assert results["a.jsonl"].rejected and not results["b.jsonl"].rejected
    assert (results["b.jsonl"].tasks, results["b.jsonl"].errors, results["c.jsonl"].tasks) == (2, len(HOSTILE_LINES), 1)
    assert status_counts(quotas.engine)["pending"] == 3
    assert (inbox / "rejected" / "a.jsonl").is_dir() and "cannot read" in (inbox / "rejected" / "a.jsonl.errors").read_text()
    report = (inbox / "done" / "b.jsonl.errors").read_text()
    assert [line.split(":")[0] for line in report.splitlines()] == [f"line {n}" for n in range(2, 2 + len(HOSTILE_LINES))]
    assert (inbox / "done" / "c.jsonl").read_text() == "an older file of the same name\n"
    assert (inbox / "done" / "c.jsonl.1").read_text() == '{"prompt": "c1"}\n'
    assert sorted(p.name for p in inbox.glob("*.jsonl")) == []


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(st.binary(max_size=300) | st.lists(st.sampled_from([line for line, _ in HOSTILE_LINES[:3]] + [
    '{"prompt": "ok"}', "[", "\ufeff{}", '{"prompt": "x\u2028y"}']), max_size=5).map(
    lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass")), min_size=1, max_size=3))
def test_inbox_fuzz_every_file_ends_in_done_or_rejected(quotas: Services, tmp_path_factory: pytest.TempPathFactory,
                                                       files: list[bytes]) -> None:
    """Whatever the files hold, ingestion never raises, leaves no file in the
    inbox, and accepts exactly the tasks its reports do not reject."""
    import os

    from balancer.sources.inbox import ingest_inbox

    inbox = tmp_path_factory.mktemp("inbox")
    past = time.time() - 10
    for i, data in enumerate(files):
        (inbox / f"f{i}.jsonl").write_bytes(data)
        os.utime(inbox / f"f{i}.jsonl", (past, past))
    before = status_counts(quotas.engine)["pending"]
    results = ingest_inbox(Services.connect(Settings.from_env()), inbox)
    assert list(inbox.glob("*.jsonl")) == []
    assert all((inbox / "done" / r.name).exists() or (inbox / "rejected" / r.name).exists() for r in results)
    assert status_counts(quotas.engine)["pending"] - before == sum(r.tasks for r in results)

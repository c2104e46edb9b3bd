"""The team's table, trusted (issue 38): only a source's own rows reach its table,
one table is one source, an unstorable answer fails alone, size limits with
one-line errors, and an export that never skips a row. Real PostgreSQL (a
throwaway "legacy" database for the team's table), real processes."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from balancer.cli import main
from balancer.domain.quota import Quota
from balancer.services import Services
from balancer.settings import Settings
from balancer.storage.schema import tasks


@pytest.fixture
def svc(migrated) -> Services:  # noqa: ANN001
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([Quota("a", 4, 100_000)])
    return services


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def solve_pending(svc: Services, answer: sa.ColumnElement | str | None = None) -> int:
    """Stand-in for the solver: pending tasks straight to solved (the status change fires the trigger)."""
    with svc.engine.begin() as conn:
        return conn.execute(sa.update(tasks).where(tasks.c.status == "pending").values(
            status="solved", answer=answer if answer is not None else "answer to " + tasks.c.prompt,
            model="a")).rowcount


def exportable(svc: Services, count: int) -> None:
    """Wait until ``count`` ended tasks are past every open transaction (another session's
    open transaction holds the export's horizon back)."""
    from balancer.storage.results import START, page, parse_cursor

    deadline = time.monotonic() + 30
    while len(page(svc.engine, parse_cursor(START), source=None, size=count + 1)[0]) < count:
        assert time.monotonic() < deadline, "the ended tasks never became exportable"
        time.sleep(0.1)


# -- finding 8: export --------------------------------------------------------------------

def test_an_export_interrupted_mid_page_resumes_with_no_row_skipped(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 8: Ctrl-C while a page is being written printed the cursor
    past the whole page, so resuming skipped the rows not yet written. Now the
    cursor printed is that of the last row written and flushed: an export killed
    (SIGINT) mid-page and resumed from its cursor gives every row, none twice."""
    count = 2500  # three pages of 1000; a page is ~300 KB, far more than a pipe holds
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"p{i} " + "x" * 200, "key": f"k{i}"}) + "\n" for i in range(count)))
    assert run(capsys, "submit", str(jsonl))[0] == 0
    assert solve_pending(svc) == count
    exportable(svc, count)
    export = subprocess.Popen([sys.executable, "-m", "balancer", "results", "export"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=os.environ.copy())
    try:
        assert export.stdout is not None
        first = [export.stdout.readline() for _ in range(50)]  # the export now waits on the full pipe, mid-page
        export.send_signal(signal.SIGINT)
        rest, err = export.communicate(timeout=60)
    finally:
        if export.poll() is None:
            export.kill()
    lines = [line for line in b"".join(first).decode().splitlines() + rest.decode().splitlines() if line]
    assert 50 <= len(lines) < count, "the export was not interrupted mid-way"
    cursor = err.decode().strip().splitlines()[-1]
    assert cursor.startswith("cursor: "), err
    code, resumed, _ = run(capsys, "results", "export", "--since", cursor.split()[-1])
    assert code == 0
    keys = [json.loads(line)["key"] for line in lines + resumed.splitlines()]
    assert len(keys) == count and set(keys) == {f"k{i}" for i in range(count)}  # no row skipped, none twice


def test_csv_cells_are_escaped_against_formula_injection(svc: Services, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """Issue 38 finding 8: a CSV cell starting with '=' was written raw, so a spreadsheet
    ran it as a formula. Cells starting with = + - @ (or a tab or CR) now start with '."""
    hostile = ["=HYPERLINK(\"http://x\",\"y\")", "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": value, "key": f"k{i}"}) + "\n" for i, value in enumerate(hostile))
                     + json.dumps({"prompt": "a=b", "key": "-7"}) + "\n")
    assert run(capsys, "submit", str(jsonl))[0] == 0
    assert solve_pending(svc, answer="=1+2") == len(hostile) + 1
    exportable(svc, len(hostile) + 1)
    code, out, _ = run(capsys, "results", "export", "--format", "csv", "--prompt")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out, newline="")))
    assert sorted(r["prompt"] for r in rows) == sorted(["'" + v for v in hostile] + ["a=b"])
    assert {r["answer"] for r in rows} == {"'=1+2"} and "'-7" in {r["key"] for r in rows}
    assert not [r for r in rows if r["id"].startswith("'") or r["prompt_tokens"].startswith("'")]  # numbers as they are
    code, out, _ = run(capsys, "results", "export")  # JSONL is data, not a sheet: written as stored
    assert code == 0 and {json.loads(line)["answer"] for line in out.splitlines()} == {"=1+2"}

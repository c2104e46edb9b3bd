"""The inbox: links refused, each file claimed once, read as a stream, and a
claim whose ingester died taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from balancer.admission.quota import Quota
from balancer.backlog.reads import status_counts
from balancer.services import Services
from balancer.settings import Settings
from balancer.sources.inbox import ingest_inbox


@pytest.fixture
def svc(migrated) -> Services:
    services = Services.connect(Settings.from_env())
    services.quotas.replace_all([Quota("a", 2, 50_000)])
    return services


def write_old(path: Path, lines: int, prefix: str = "p") -> Path:
    with path.open("w") as fh:
        for i in range(lines):
            fh.write(json.dumps({"prompt": f"{prefix}{i} " + "word " * 40}) + "\n")
    past = time.time() - 10
    os.utime(path, (past, past), follow_symlinks=False)
    return path


def test_a_link_in_the_inbox_is_refused_unread(svc: Services, tmp_path: Path) -> None:
    inbox, outside = tmp_path / "inbox", tmp_path / "secret"
    inbox.mkdir()
    outside.mkdir()
    target = write_old(outside / "private.jsonl", 5)
    (inbox / "leak.jsonl").symlink_to(target)
    (inbox / "dangling.jsonl").symlink_to(outside / "missing.jsonl")
    os.utime(inbox / "leak.jsonl", (time.time() - 10,) * 2, follow_symlinks=False)
    os.utime(inbox / "dangling.jsonl", (time.time() - 10,) * 2, follow_symlinks=False)
    results = ingest_inbox(svc, inbox)
    assert status_counts(svc.engine)["pending"] == 0
    assert sorted(r.name for r in results if r.rejected) == ["dangling.jsonl", "leak.jsonl"]
    moved = inbox / "rejected" / "leak.jsonl"
    assert moved.is_symlink() and "symbolic link" in (inbox / "rejected" / "leak.jsonl.errors").read_text()
    assert target.exists()  # the file it pointed at is untouched


def test_a_file_with_refused_lines_says_so_in_the_log(svc: Services, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Its bad lines are listed in done/<file>.errors; the dispatcher's log says so, per file (it said
    nothing, and a file of bad lines alone was only a report in done/: a new user's probe)."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    path = write_old(inbox / "mixed.jsonl", 2)
    with path.open("a") as fh:
        fh.write("garbage only\n")
    os.utime(path, (time.time() - 10,) * 2)
    with caplog.at_level("WARNING", logger="balancer.sources.inbox"):
        (result,) = ingest_inbox(svc, inbox)
    assert (result.tasks, result.errors) == (2, 1)
    assert caplog.messages == ["inbox file mixed.jsonl: 2 task(s) created, 1 line(s) refused, listed in "
                               "done/mixed.jsonl.errors"]
    assert "line 3" in (inbox / "done" / "mixed.jsonl.errors").read_text()


def test_a_processing_link_is_not_followed(svc: Services, tmp_path: Path) -> None:
    inbox, outside = tmp_path / "inbox", tmp_path / "elsewhere"
    inbox.mkdir()
    outside.mkdir()
    write_old(outside / "x.jsonl", 3)
    (inbox / "processing").symlink_to(outside)
    ingest_inbox(svc, inbox)
    assert status_counts(svc.engine)["pending"] == 0


def test_two_ingesters_never_read_one_file_at_once(svc: Services, tmp_path: Path) -> None:
    """Both pollers see the file; only the one that claims it reads it (before,
    both parsed all of it and one found its digest taken at the end)."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write_old(inbox / "big.jsonl", 20_000)
    results: list = []
    barrier = threading.Barrier(2)

    def ingest() -> None:
        services = Services.connect(Settings.from_env())
        barrier.wait()
        results.extend(ingest_inbox(services, inbox))

    threads = [threading.Thread(target=ingest) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(r.name, r.tasks, r.duplicate) for r in results] == [("big.jsonl", 20_000, False)]
    assert status_counts(svc.engine)["pending"] == 20_000
    assert (inbox / "done" / "big.jsonl").exists() and not list((inbox / "processing").iterdir())


def peak_while_ingesting(svc: Services, inbox: Path) -> int:
    tracemalloc.start()
    try:
        ingest_inbox(svc, inbox)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_file_is_read_as_a_stream(svc: Services, tmp_path: Path) -> None:
    """Python's own allocations while ingesting do not grow with the file: four
    times the lines, about the same peak (before: the bytes, the decoded text
    and every parsed line, at once; 37 MB for a 4.4 MB file). Ingesting each file
    as one batch gives a ratio of 2.6 here; streaming, 1.0."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write_old(inbox / "small.jsonl", 2_000, prefix="s")
    small = peak_while_ingesting(svc, inbox)
    write_old(inbox / "large.jsonl", 8_000, prefix="l")
    large = peak_while_ingesting(svc, inbox)
    assert status_counts(svc.engine)["pending"] == 10_000
    assert large < small * 1.5, f"peak {large:,} bytes for 8,000 lines, {small:,} for 2,000"


CLAIMANT = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_claim_whose_ingester_died_is_taken_over(svc: Services, tmp_path: Path) -> None:
    """A file in processing/ locked by a live process is left alone; once that
    process is killed (-9, the kernel drops its lock) the next poll ingests it, once."""
    inbox = tmp_path / "inbox"
    (inbox / "processing").mkdir(parents=True)
    path = write_old(inbox / "processing" / "orphan.jsonl", 30)
    claimant = subprocess.Popen([sys.executable, "-c", CLAIMANT, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert claimant.stdout is not None and claimant.stdout.readline().strip() == "claimed"
        assert ingest_inbox(svc, inbox) == []
        assert status_counts(svc.engine)["pending"] == 0
    finally:
        claimant.kill()
        claimant.wait(timeout=10)
    results = ingest_inbox(svc, inbox)
    assert [(r.name, r.tasks) for r in results] == [("orphan.jsonl", 30)]
    assert status_counts(svc.engine)["pending"] == 30
    assert (inbox / "done" / "orphan.jsonl").exists()

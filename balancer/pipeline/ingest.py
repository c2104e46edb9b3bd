"""Inbox ingestion: every ``*.jsonl`` file in ``BALANCER_INBOX`` becomes tasks, once.

Exactly once, even with two beats: the file's (name, sha256) row and its tasks
are inserted in one transaction, and a second ingester's insert of the same
row conflicts and inserts nothing. Ingested files move to ``done/``; bad
lines are listed in ``<file>.errors`` beside it. A file that cannot be
processed at all (unreadable, or its insert fails) moves to ``rejected/``
with its ``.errors`` report, so it never blocks the files sorted after it.
A name already taken in ``done/`` or ``rejected/`` gets a numbered suffix:
nothing is overwritten.

Writers should write to a temporary name and rename to ``*.jsonl``; files
modified in the last second are left for the next poll.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from balancer.domain.intake import parse_tasks
from balancer.services import Services
from balancer.storage.intake import insert_tasks
from balancer.storage.schema import ingested_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestedFile:
    name: str
    tasks: int
    errors: int
    duplicate: bool
    rejected: bool = False


def free_name(folder: Path, name: str, data: bytes) -> Path:
    """Where a file holding ``data`` goes in ``folder``: ``name``, unless a
    different file has it, then ``name.1``, ``name.2`` ...: a move never
    overwrites another file (the same content again is the same file).

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "a.jsonl").write_bytes(b"x")
    >>> [free_name(d, n, data).name for n, data in (("a.jsonl", b"y"), ("a.jsonl", b"x"), ("b.jsonl", b"y"))]
    ['a.jsonl.1', 'a.jsonl', 'b.jsonl']
    """
    candidate, n = folder / name, 0
    while candidate.exists() and candidate.read_bytes() != data:
        n += 1
        candidate = folder / f"{name}.{n}"
    return candidate


def _move(path: Path, data: bytes, folder: Path, report: str) -> None:
    """Move ``path`` (holding ``data``) into ``folder`` under a free name, its error report beside it."""
    folder.mkdir(exist_ok=True)
    target = free_name(folder, path.name, data)
    try:
        path.replace(target)
    except FileNotFoundError:  # another ingester moved it, to the same place
        pass
    if report:
        target.with_name(target.name + ".errors").write_text(report, encoding="utf-8", errors="backslashreplace")


def ingest_inbox(services: Services, inbox: Path, *, min_age_seconds: float = 1.0) -> list[IngestedFile]:
    if not inbox.is_dir():
        return []
    results = []
    paths = sorted(inbox.glob("*.jsonl"))
    models = {q.name: q.burst for q in services.quotas.all()} if paths else {}
    for path in paths:
        try:
            if time.time() - path.stat().st_mtime < min_age_seconds:
                continue
            data = path.read_bytes()
        except FileNotFoundError:  # another ingester moved it
            continue
        except OSError as exc:
            log.warning("inbox file %s is unreadable, moved to rejected/: %s", path.name, exc)
            _move(path, b"", inbox / "rejected", f"cannot read the file: {exc}\n")
            results.append(IngestedFile(path.name, 0, 1, duplicate=False, rejected=True))
            continue
        try:
            results.append(_ingest_file(services, inbox, path, data, models))
        except (OperationalError, PoolTimeout):
            raise  # PostgreSQL is away: the file is fine, the next poll takes it
        except Exception as exc:  # noqa: BLE001 - one poison file must not starve the others
            log.exception("inbox file %s could not be ingested, moved to rejected/", path.name)
            _move(path, data, inbox / "rejected", f"not ingested: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n")
            results.append(IngestedFile(path.name, 0, 1, duplicate=False, rejected=True))
    return results


def _ingest_file(services: Services, inbox: Path, path: Path, data: bytes, models: dict[str, int]) -> IngestedFile:
    digest = hashlib.sha256(data).hexdigest()
    rows, errors = parse_tasks(
        data.decode("utf-8", errors="surrogateescape"),  # a bad byte fails its line, not the file
        models=models,
        default_max_tokens=services.settings.expected_output_tokens,
        default_source=f"inbox:{path.name}",
    )
    with services.engine.begin() as conn:
        claimed = conn.execute(
            pg_insert(ingested_files)
            .values(name=path.name, sha256=digest, tasks=len(rows))
            .on_conflict_do_nothing()
            .returning(ingested_files.c.name)
        ).first()
        inserted = insert_tasks(conn, rows, dedup=services.settings.dedup) if claimed else []  # a keyed task already present is skipped
    _move(path, data, inbox / "done", "".join(f"{e}\n" for e in errors) if claimed else "")
    return IngestedFile(path.name, len(inserted), len(errors), duplicate=not claimed)



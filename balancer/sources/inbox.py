"""Inbox ingestion: every ``*.jsonl`` file in ``BALANCER_INBOX`` becomes tasks, once.

Exactly once, even with two beats: the file's (name, sha256) row and its tasks
are inserted in one transaction, and a second ingester's insert of the same
row conflicts and inserts nothing. Ingested files move to ``done/``; bad
lines are listed in ``<file>.errors`` beside it. A file that cannot be
processed at all (unreadable, or its insert fails) moves to ``rejected/``
with its ``.errors`` report, so it never blocks the files sorted after it.
A name already taken in ``done/`` or ``rejected/`` gets a numbered suffix:
nothing is overwritten.

Only regular files are read: a symbolic link (to a file anywhere) or
anything else that is not a plain file in the inbox moves to ``rejected/``
unread. A file is *claimed* before it is read: opened without following
links, locked (``flock``, released by the kernel if the ingester dies) and
renamed into ``processing/``; another ingester skips it, and one whose
claimant died takes it from there at its next poll. It is read as a
stream, twice (its digest, then its lines) in batches of :data:`BATCH`
lines: memory stays bounded whatever its size, and the thread yields between
batches, so the dispatcher's other control thread keeps dispatching.

Writers should write to a temporary name and rename to ``*.jsonl``; files
modified in the last second are left for the next poll.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from balancer.backlog.insert import insert_tasks
from balancer.backlog.intake import LineError, TaskRow, batches, parse_stream
from balancer.services import Services
from balancer.sources.store import intake_rules
from balancer.storage.schema import ingested_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestedFile:
    name: str
    tasks: int
    errors: int
    duplicate: bool
    rejected: bool = False


#: Lines parsed and inserted at a time (the memory an ingestion holds).
BATCH = 1000
PROCESSING = "processing"


def file_digest(fh: BinaryIO) -> str:
    """sha256 of an open file, read in 1 MB pieces from its start."""
    fh.seek(0)
    digest = hashlib.sha256()
    while chunk := fh.read(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _same_file(candidate: Path, digest: str | None) -> bool:
    if digest is None or candidate.is_symlink() or not candidate.is_file():
        return False
    with candidate.open("rb") as fh:
        return file_digest(fh) == digest


def free_name(folder: Path, name: str, digest: str | None) -> Path:
    """Where a file whose sha256 is ``digest`` goes in ``folder``: ``name``,
    unless a different file has it, then ``name.1``, ``name.2`` ...: a move
    never overwrites another file (the same content again is the same file;
    ``digest`` None, e.g. a link, is never the same).

    >>> import tempfile; d = Path(tempfile.mkdtemp()); _ = (d / "a.jsonl").write_bytes(b"x")
    >>> x, y = hashlib.sha256(b"x").hexdigest(), hashlib.sha256(b"y").hexdigest()
    >>> [free_name(d, n, h).name for n, h in (("a.jsonl", y), ("a.jsonl", x), ("b.jsonl", y), ("a.jsonl", None))]
    ['a.jsonl.1', 'a.jsonl', 'b.jsonl', 'a.jsonl.1']
    """
    candidate, n = folder / name, 0
    while os.path.lexists(candidate) and not _same_file(candidate, digest):
        n += 1
        candidate = folder / f"{name}.{n}"
    return candidate


def _move(path: Path, digest: str | None, folder: Path, report: str | Path = "") -> Path:
    """Move ``path`` into ``folder`` under a free name, its error report (text,
    or a file to move) beside it; the name it took. A link is moved as a link, never followed."""
    folder.mkdir(exist_ok=True)
    target = free_name(folder, path.name, digest)
    try:
        path.replace(target)
    except FileNotFoundError:  # another ingester moved it, to the same place
        pass
    errors = target.with_name(target.name + ".errors")
    if isinstance(report, Path):
        if report.exists():
            report.replace(errors)
    elif report:
        errors.write_text(report, encoding="utf-8", errors="backslashreplace")
    return target


class NotAFile(Exception):
    """An inbox entry that is a link, or not a regular file."""


def _claim(path: Path) -> BinaryIO | None:
    """Open ``path`` without following a link and lock it for this ingester;
    None if another ingester holds it or it is gone. Raises NotAFile for a
    link or anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if path.is_symlink():
            raise NotAFile("a symbolic link: only regular files in the inbox are read") from None
        raise exc
    fh = os.fdopen(fd, "rb")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAFile("not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return None
        try:  # still the file at that name (not one a finished claimant moved away)?
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                fh.close()
                return None
        except FileNotFoundError:
            fh.close()
            return None
    except BaseException:
        fh.close()
        raise
    return fh


def ingest_inbox(services: Services, inbox: Path, *, min_age_seconds: float = 1.0) -> list[IngestedFile]:
    """Ingest every file left in ``processing/`` by an ingester that died, then
    every ``*.jsonl`` file in the inbox modified more than ``min_age_seconds`` ago."""
    if not inbox.is_dir():
        return []
    processing = inbox / PROCESSING
    results: list[IngestedFile] = []
    models: dict[str, int] | None = None
    real_dir = processing.is_dir() and not processing.is_symlink()  # a link there could lead anywhere
    orphans = sorted(processing.glob("*.jsonl")) if real_dir else []
    for path in [*orphans, *sorted(inbox.glob("*.jsonl"))]:
        try:
            if path.parent == inbox and time.time() - path.lstat().st_mtime < min_age_seconds:
                continue
            fh = _claim(path)
        except FileNotFoundError:
            continue
        except NotAFile as exc:
            log.warning("inbox entry %s refused, moved to rejected/: %s", path.name, exc)
            _move(path, None, inbox / "rejected", f"not read: {exc}\n")
            results.append(IngestedFile(path.name, 0, 1, duplicate=False, rejected=True))
            continue
        except OSError as exc:
            log.warning("inbox file %s is unreadable, moved to rejected/: %s", path.name, exc)
            _move(path, None, inbox / "rejected", f"cannot read the file: {exc}\n")
            results.append(IngestedFile(path.name, 0, 1, duplicate=False, rejected=True))
            continue
        if fh is None:
            continue  # another ingester holds it
        with fh:
            if path.parent == inbox:  # claimed: into processing/, still locked
                processing.mkdir(exist_ok=True)
                if processing.is_symlink():
                    raise NotADirectoryError(f"{processing} is a link: remove it, ingestion needs a directory there")
                if os.path.lexists(processing / path.name):
                    continue  # a file of that name is being ingested: this one waits for the next poll
                path = path.replace(processing / path.name)
            if models is None:
                models = {q.name: q.burst for q in services.quotas.all()}
            results.append(_ingest_claimed(services, inbox, path, fh, models))
    return results


def _ingest_claimed(services: Services, inbox: Path, path: Path, fh: BinaryIO, models: dict[str, int]) -> IngestedFile:
    """Ingest a claimed file in ``processing/``: to done/ or rejected/, or left
    there for the next poll if PostgreSQL is away."""
    report = path.with_name(path.name + ".errors")
    digest: str | None = None
    try:
        digest = file_digest(fh)
        result = _ingest_file(services, path, fh, digest, models, report)
    except (OperationalError, PoolTimeout):
        raise  # PostgreSQL is away: the file is fine, the next poll takes it from processing/
    except Exception as exc:  # noqa: BLE001 - one poison file must not starve the others
        log.exception("inbox file %s could not be ingested, moved to rejected/", path.name)
        report.unlink(missing_ok=True)
        _move(path, digest, inbox / "rejected", f"not ingested: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n")
        return IngestedFile(path.name, 0, 1, duplicate=False, rejected=True)
    moved = _move(path, digest, inbox / "done", report if not result.duplicate else "")
    report.unlink(missing_ok=True)
    if result.errors:  # the lines refused are in the report; the log says there is one
        log.warning("inbox file %s: %d task(s) created, %d line(s) refused, listed in %s", path.name, result.tasks,
                    result.errors, moved.relative_to(inbox).as_posix() + ".errors")
    return result


def _ingest_file(services: Services, path: Path, fh: BinaryIO, digest: str, models: dict[str, int],
                 report: Path) -> IngestedFile:
    created = errors = 0
    with services.engine.begin() as conn:
        claimed = conn.execute(
            pg_insert(ingested_files)
            .values(name=path.name, sha256=digest, tasks=0)
            .on_conflict_do_nothing()
            .returning(ingested_files.c.name)
        ).first()
        if not claimed:
            return IngestedFile(path.name, 0, 0, duplicate=True)
        fh.seek(0)
        rules = intake_rules(conn, services.settings)  # no table source's name, prompts and names within their limits
        stream = parse_stream(fh, models=models, default_max_tokens=services.settings.expected_output_tokens,
                              default_source=f"inbox:{path.name}", rules=rules)
        with report.open("w", encoding="utf-8", errors="backslashreplace") as out:
            for batch in batches(stream, BATCH):
                rows = [item for item in batch if isinstance(item, TaskRow)]
                bad = [item for item in batch if isinstance(item, LineError)]
                out.writelines(f"{e}\n" for e in bad)
                inserted = insert_tasks(conn, rows, dedup=services.settings.dedup)  # a keyed task already present is skipped
                created, errors = created + len(inserted), errors + len(bad)
                time.sleep(0)  # let the dispatcher's other thread run
        conn.execute(ingested_files.update()
                     .where(ingested_files.c.name == path.name, ingested_files.c.sha256 == digest)
                     .values(tasks=created))
    if not errors:
        report.unlink(missing_ok=True)
    return IngestedFile(path.name, created, errors, duplicate=False)

"""Inbox ingestion: every ``*.jsonl`` file in ``BALANCER_INBOX`` becomes tasks, once.

Exactly once, even with two beats: the file's (name, sha256) row and its tasks
are inserted in one transaction, and a second ingester's insert of the same
row conflicts and inserts nothing. Ingested files move to ``done/``; bad
lines are listed in ``<file>.errors`` beside it.

Writers should write to a temporary name and rename to ``*.jsonl``; files
modified in the last second are left for the next poll.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.dialects.postgresql import insert as pg_insert

from balancer.domain.intake import parse_tasks
from balancer.services import Services
from balancer.storage.schema import ingested_files
from balancer.storage.tasks import insert_tasks


@dataclass(frozen=True)
class IngestedFile:
    name: str
    tasks: int
    errors: int
    duplicate: bool


def ingest_inbox(services: Services, inbox: Path, *, min_age_seconds: float = 1.0) -> list[IngestedFile]:
    if not inbox.is_dir():
        return []
    done = inbox / "done"
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
        digest = hashlib.sha256(data).hexdigest()
        rows, errors = parse_tasks(
            data.decode("utf-8", errors="replace"),
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
            if claimed:
                insert_tasks(conn, rows)
        done.mkdir(exist_ok=True)
        if errors and claimed:
            (done / f"{path.name}.errors").write_text("".join(f"{e}\n" for e in errors))
        try:
            path.replace(done / path.name)
        except FileNotFoundError:
            pass
        results.append(IngestedFile(path.name, len(rows) if claimed else 0, len(errors), duplicate=not claimed))
    return results



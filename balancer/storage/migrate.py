"""Alembic, driven from code: ``balancer db upgrade`` and the startup check.

The check reads without SQLAlchemy (:mod:`balancer.storage.rows`): ``status`` makes it on its
read-only snapshot; Alembic is imported only to upgrade, or when the database is not at the
newest migration file's revision."""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

import psycopg2

from balancer.errors import ConfigError, printable
from balancer.storage.rows import RowSource, fetch

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from sqlalchemy.engine import Engine


def alembic_config(engine: Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files("balancer.storage") / "migrations"))
    config.attributes["engine"] = engine
    return config


def _scripts() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(resources.files("balancer.storage") / "migrations"))


def head_revision() -> str:
    head = _scripts().get_current_head()
    if head is None:  # pragma: no cover - the package ships its migrations
        raise RuntimeError("no Alembic head revision in balancer/storage/migrations")
    return head


def revisions() -> list[str]:
    """Every revision this code ships, oldest first."""
    return [r.revision for r in reversed(list(_scripts().walk_revisions()))]


def upgrade(engine: Engine, revision: str = "head") -> str | None:
    """Upgrade to ``revision`` (``head``, ``base`` or a shipped one; never down).
    Returns the revision the database is at afterwards (None: no tables)."""
    known = revisions()
    if revision not in ("head", "base", *known):
        raise ConfigError(f"unknown revision {printable(revision)!r}: use head or one of {', '.join(known)}")
    from balancer.storage.db import check_reachable

    check_reachable(engine)
    current = current_revision(engine)
    behind = current is None or revision == "head" or (
        revision != "base" and current in known and known.index(revision) > known.index(current)
    )
    if behind:
        from alembic import command

        command.upgrade(alembic_config(engine), revision)
    return current_revision(engine)


def newest_file_revision() -> str | None:
    """The revision the newest migration file names by its prefix (``0012_flexible_lane.py``: ``0012``),
    read from the file names alone: no Alembic import, no migration module loaded."""
    folder = resources.files("balancer.storage") / "migrations" / "versions"
    prefixes = [p.name.split("_", 1)[0] for p in folder.iterdir() if p.name.endswith(".py") and p.name[:1].isdigit()]
    return max(prefixes, default=None)


def current_revision(db: RowSource) -> str | None:
    """The database's Alembic revision; None when it has no ``alembic_version`` table (never migrated)."""
    try:
        found = fetch(db, "SELECT version_num FROM alembic_version")
    except Exception as exc:  # psycopg2's error, or SQLAlchemy's wrapping it (its ``orig``)
        if isinstance(getattr(exc, "orig", exc), psycopg2.ProgrammingError):
            return None
        raise
    return found[0][0] if found else None


def require_revision(current: str | None) -> None:
    """Fail with one line, not a traceback, when ``current`` (the database's revision) is behind the code.

    A database at the newest file's revision is up to date (the fast path, for
    ``status``); anything else asks Alembic for the head, which decides."""
    if current is not None and current == newest_file_revision():
        return
    if current != head_revision():
        have = current or "none"
        raise ConfigError(
            f"database schema is at revision {have}, code needs {head_revision()}: run `balancer db upgrade`"
        )


def require_migrated(engine: Engine) -> None:
    """:func:`require_revision` on ``engine``'s database, once it answers."""
    from balancer.storage.db import check_reachable

    check_reachable(engine)
    require_revision(current_revision(engine))

"""Alembic, driven from code: ``balancer db upgrade`` and the startup check."""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine

from balancer.errors import ConfigError, printable
from balancer.storage.db import check_reachable, current_revision

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory


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


def require_migrated(engine: Engine) -> None:
    """Fail with one line, not a traceback, when the schema is behind the code.

    A database at the newest file's revision is up to date (the fast path, for
    ``status``); anything else asks Alembic for the head, which decides."""
    check_reachable(engine)
    current = current_revision(engine)
    if current is not None and current == newest_file_revision():
        return
    if current != head_revision():
        have = current or "none"
        raise ConfigError(
            f"database schema is at revision {have}, code needs {head_revision()}: run `balancer db upgrade`"
        )

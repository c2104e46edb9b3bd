"""Alembic, driven from code: ``balancer db upgrade`` and the startup check."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from balancer.errors import ConfigError, printable
from balancer.storage.db import check_reachable, current_revision


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("balancer.storage") / "migrations"))
    config.attributes["engine"] = engine
    return config


def _scripts() -> ScriptDirectory:
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
        command.upgrade(alembic_config(engine), revision)
    return current_revision(engine)


def require_migrated(engine: Engine) -> None:
    """Fail with one line, not a traceback, when the schema is behind the code."""
    check_reachable(engine)
    current = current_revision(engine)
    if current != head_revision():
        have = current or "none"
        raise ConfigError(
            f"database schema is at revision {have}, code needs {head_revision()}: run `balancer db upgrade`"
        )

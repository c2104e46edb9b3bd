"""Alembic, driven from code: ``balancer db upgrade`` and the startup check."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from balancer.errors import ConfigError
from balancer.storage.db import check_reachable, current_revision


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(resources.files("balancer.storage") / "migrations"))
    config.attributes["engine"] = engine
    return config


def head_revision() -> str:
    script = ScriptDirectory(str(resources.files("balancer.storage") / "migrations"))
    head = script.get_current_head()
    if head is None:  # pragma: no cover - the package ships its migrations
        raise RuntimeError("no Alembic head revision in balancer/storage/migrations")
    return head


def upgrade(engine: Engine, revision: str = "head") -> None:
    check_reachable(engine)
    command.upgrade(alembic_config(engine), revision)


def require_migrated(engine: Engine) -> None:
    """Fail with one line, not a traceback, when the schema is behind the code."""
    check_reachable(engine)
    current = current_revision(engine)
    if current != head_revision():
        have = current or "none"
        raise ConfigError(
            f"database schema is at revision {have}, code needs {head_revision()}: run `balancer db upgrade`"
        )

"""``balancer db ...`` (schema migrations) and ``balancer embedded ...``."""

from __future__ import annotations

import click

from balancer.cli import services, settings


@click.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def db_upgrade(revision: str) -> None:
    """Create or upgrade the tables in BALANCER_DATABASE_URL."""
    from balancer.storage.migrate import upgrade

    svc = services()
    upgrade(svc.engine, revision)
    click.echo(f"database at revision {revision}")


@click.group()
def embedded() -> None:
    """The embedded Redis + PostgreSQL used when no BALANCER_*_URL is set."""


@embedded.command("stop")
def embedded_stop() -> None:
    """Stop the embedded servers under BALANCER_HOME."""
    from balancer.devtools.embedded import stop_stack

    stopped = stop_stack(settings().home)
    click.echo("stopped " + (", ".join(stopped) if stopped else "nothing (not running)"))

"""``balancer db ...`` (schema migrations) and ``balancer embedded ...``."""

from __future__ import annotations

import shlex

import click

from balancer.cli import embedded_stack, embedded_started_note, services, settings
from balancer.errors import BalancerError


@click.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Target revision (head, or one of `0001`...).")
def db_upgrade(revision: str) -> None:
    """Create or upgrade the tables in BALANCER_DATABASE_URL (never downgrades)."""
    from balancer.storage.migrate import head_revision, revisions, upgrade

    svc = services()
    at = upgrade(svc.engine, revision)
    wanted = head_revision() if revision == "head" else revision
    if at == wanted:
        click.echo(f"database at revision {at}")
        if note := embedded_started_note():
            click.echo(note)
    else:  # an older target than the database: upgrade leaves it where it is
        below = "base" if wanted == "base" else f"revision {wanted}"
        click.echo(f"database stays at revision {at or 'none'}: {below} is not above it, and db upgrade never "
                   f"downgrades (revisions: {', '.join(revisions())})")


@click.group()
def embedded() -> None:
    """The embedded Redis + PostgreSQL used when no BALANCER_*_URL is set."""


@embedded.command("stop")
def embedded_stop() -> None:
    """Stop the embedded servers under BALANCER_HOME."""
    from balancer.devtools.embedded import stop_stack

    stopped, holders = stop_stack(settings().home)
    click.echo("stopped " + (", ".join(stopped) if stopped else "nothing (not running)"))
    if holders:
        raise BalancerError(f"the embedded PostgreSQL keeps running: process(es) {', '.join(map(str, holders))} "
                            "still use it; stop them, then run `balancer embedded stop` again")


@embedded.command("env")
def embedded_env() -> None:
    """Print the embedded servers' URLs as shell exports, starting them if they are not running:
    `eval "$(balancer embedded env)"` points a PostgreSQL client, or a source's URL variable, at them."""
    redis_url, database_url = embedded_stack(settings().home)
    for name, url in (("BALANCER_REDIS_URL", redis_url), ("BALANCER_DATABASE_URL", database_url)):
        click.echo(f"export {name}={shlex.quote(url)}")
    if note := embedded_started_note():
        click.echo(note, err=True)  # not on stdout, which `eval` reads

"""``balancer source unwritable NAME [--retry | --drop]``: the write-backs a source's table refused.

A write-back the team's table refuses (a CHECK, a value too long for its column,
a character its encoding lacks) is tried again after a back-off; after
``BALANCER_WRITEBACK_ATTEMPTS`` refusals it is left ``unwritable``
(:mod:`balancer.sources.outbox`). This command lists them with their errors;
once the cause is fixed (the constraint or the column changed), ``--retry``
writes them again; ``--drop`` gives them up (their rows stay as they are, and are
not asked again). Both are audited in ``source_changes``.
"""

from __future__ import annotations

import json

import click

from balancer.cli.startwait import migrated
from balancer.errors import BalancerError, printable


@click.command("unwritable")
@click.argument("name")
@click.option("--retry", is_flag=True, help="Write them again (once the cause is fixed): they wait again, refusals reset.")
@click.option("--drop", is_flag=True, help="Give them up: never written, never asked again.")
@click.option("--json", "as_json", is_flag=True, help="List them as JSON.")
@click.option("--by", help="Who made the change (default: the OS user), for the audit.")
def unwritable_command(name: str, retry: bool, drop: bool, as_json: bool, by: str | None) -> None:
    """List the write-backs of source NAME its table refused until they were left
    unwritable, each with its error; or write them again (--retry), or drop them (--drop)."""
    import sqlalchemy as sa

    from balancer.sources.outbox import settle_unwritable, unwritable
    from balancer.sources.schema import sources
    from balancer.storage.audit import default_actor

    if retry and drop:
        raise BalancerError("--retry or --drop, not both")
    svc = migrated()
    with svc.engine.connect() as conn:
        if conn.execute(sa.select(sources.c.name).where(sources.c.name == name)).first() is None:
            raise BalancerError(f"no source {printable(name, 80)!r} (balancer source list)")
    if retry or drop:
        action = "retry" if retry else "drop"
        n = settle_unwritable(svc.engine, name, action, by=by or default_actor())
        done = "waiting to be written again" if retry else "dropped (never written, not asked again)"
        click.echo(printable(f"{name}: {n} unwritable write-back(s) {done}"))
        return
    rows = unwritable(svc.engine, name)
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:  # the row by its key in the team's table, then balancer's own task id (its logs name it)
        click.echo(printable(f"key {r['key']} ({r['outcome']}; balancer task {r['task_id']}), refused {r['refusals']} "
                             f"time(s): {r['last_error']}", limit=500))
    hint = "; --retry writes them again once the cause is fixed, --drop gives them up" if rows else ""
    click.echo(printable(f"{name}: {len(rows)} unwritable write-back(s){hint}"))

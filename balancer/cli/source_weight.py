"""``balancer source set NAME --weight N``: a source's share of the dispatch window.

Any source has a weight, JSONL and inbox ones included (default 1); the
dispatcher fills its window across sources in proportion
(:mod:`balancer.domain.fairshare`). The change is audited in
``source_changes`` and applies to the next dispatch round.
"""

from __future__ import annotations

import click

from balancer.cli.startwait import migrated
from balancer.domain.fairshare import MAX_WEIGHT
from balancer.errors import ConfigError, printable

#: The longest source name (as a task's ``key``).
MAX_SOURCE_NAME = 256


def check_source_name(name: str) -> str:
    """A source name: 1 to 256 printable characters, not only spaces."""
    if not name.strip() or len(name) > MAX_SOURCE_NAME or not name.isprintable():
        raise ConfigError(f"a source name is 1 to {MAX_SOURCE_NAME} printable characters, not {printable(name)!r}")
    return name


@click.command("set")
@click.argument("name")
@click.option("--weight", type=click.IntRange(1, MAX_WEIGHT), required=True,
              help=f"The source's share relative to others (1 to {MAX_WEIGHT:,}; a source with none set has 1).")
@click.option("--by", help="Who made the change (default: the OS user).")
def set_command(name: str, weight: int, by: str | None) -> None:
    """Set a source's weight: its share of the dispatch window within a priority."""
    from balancer.storage.quotas import default_actor
    from balancer.storage.source_weights import set_weight

    check_source_name(name)
    svc = migrated()
    with svc.engine.begin() as conn:
        changed = set_weight(conn, name, weight, by=by or default_actor())
    click.echo(f"{name}: weight {weight}" if changed else f"{name}: unchanged (weight {weight})")

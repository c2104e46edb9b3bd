"""``balancer tasks ...``: see, retry, cancel and prune tasks while the pipeline runs.

``retry``, ``cancel`` and ``prune`` are dry runs unless ``--yes``; they never
touch a ready, queued or running task (balancer.backlog.operations, balancer.backlog.retention).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click

from balancer.cli import print_table
from balancer.cli.pipeline import _ask_for_dispatch, _migrated
from balancer.errors import BalancerError, printable


def _when(value: datetime | None) -> datetime | None:
    """A naive time given on the command line is UTC."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


def filters(command: Any, statuses: str = "pending, ready, queued, running, solved, failed or cancelled") -> Any:
    """The filter options every ``tasks`` subcommand takes (``statuses``: the ones ``--status`` may name)."""
    for option in reversed([
        click.option("--status", help=statuses),
        click.option("--model", help="tasks that ran on MODEL or may use it"),
        click.option("--source", help="the source recorded at submit or ingestion"),
        click.option("--created-after", type=click.DateTime(), help="UTC, e.g. 2026-11-21 or 2026-11-21T09:00:00"),
        click.option("--created-before", type=click.DateTime(), help="UTC"),
    ]):
        command = option(command)
    return command


def _filter(status: str | None, model: str | None, source: str | None, created_after: datetime | None,
            created_before: datetime | None) -> Any:
    from balancer.backlog.operations import TaskFilter

    return TaskFilter(status, model, source, _when(created_after), _when(created_before))


@click.group()
def tasks() -> None:
    """List, show, retry, cancel and prune tasks (safe while the pipeline runs)."""


@tasks.command("list")
@filters
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True, help="At most this many tasks.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def tasks_list(limit: int, as_json: bool, **given: Any) -> None:
    """The matching tasks, newest first."""
    from balancer.backlog.operations import list_tasks

    flt = _filter(**given)
    engine = _migrated().engine
    rows = list_tasks(engine, flt, limit=limit)
    if not rows:
        _say_what_matched_nothing(engine, flt)
    if as_json:
        click.echo(json.dumps([dict(r._mapping) for r in rows], default=str, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"tasks ({len(rows)} shown, newest first)")
    for col in ("id", "status", "model", "source", "attempts", "created", "prompt", "error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(str(r.id), r.status, r.model or ",".join(r.allowed_models or []) or "any", printable(r.source, 30),
                      str(r.attempts), f"{r.created_at:%Y-%m-%d %H:%M:%S}", printable(r.prompt_preview, 40),
                      printable(r.error or "", 60))
    print_table(table, 140)


@tasks.command("show")
@click.argument("task_id", type=int)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def tasks_show(task_id: int, as_json: bool) -> None:
    """One task: prompt preview, status, model, attempts, errors and timings; an ended task of a
    source table, where its write-back stands."""
    from balancer.backlog.operations import get_task

    svc = _migrated()
    row = get_task(svc.engine, task_id)
    if row is None:
        raise BalancerError(f"no task {task_id}")
    data = dict(row._mapping)
    if data["status"] == "pending":  # what it waits on, as status sees its models now
        from balancer.costs.budget import held
        from balancer.views.overview import read_overview
        from balancer.views.summary import waits_on

        o = read_overview(svc)
        data["waits_on"] = waits_on(data["allowed_models"], data["source"], o.rows,
                                    {name: o.health.model_text(name) for name in o.health.models}, held(o.budgets))
    from balancer.sources.outbox import task_writeback

    with svc.engine.connect() as conn:
        writeback = task_writeback(conn, task_id)  # an ended task of a source table: where its write-back stands
    if writeback is not None:
        data["writeback"] = writeback.as_dict()
    if as_json:
        click.echo(json.dumps(data, default=str, indent=2))
        return
    for key in ("id", "status", "source", "key", "metadata", "priority", "model", "allowed_models", "attempts",
                "rate_limited", "hedges", "hedge_model", "max_tokens", "estimated_tokens", "prompt_tokens",
                "completion_tokens", "error", "created_at", "queued_at", "started_at", "solved_at", "updated_at"):
        click.echo(f"{key:>18}: {printable(_shown(data[key]), 300)}")
    for line in data.get("waits_on", []):
        click.echo(f"{'waits on':>18}: {printable(line, 300)}")
    if writeback is not None:
        click.echo(f"{'write-back':>18}: {printable(writeback.text(), 400)}")
    click.echo(f"{'prompt':>18}: {printable(data['prompt'], 200)}")
    if data["answer"] is not None:
        click.echo(f"{'answer':>18}: {printable(data['answer'], 200)}")


def _shown(value: Any) -> str:
    """A field as ``tasks show`` prints it: JSON for metadata and lists, ``-`` for none.

    >>> _shown({"t": 1}), _shown(["a", "b"]), _shown(None), _shown(3)
    ('{"t": 1}', '["a", "b"]', '-', '3')
    """
    if value is None:
        return "-"
    if isinstance(value, dict | list):
        return json.dumps(value, default=str, ensure_ascii=False)
    return str(value)


def _say_what_matched_nothing(engine: Any, flt: Any) -> None:
    """On stderr, each name of ``flt`` that no task has (a typo reads as "nothing to do")."""
    from balancer.backlog.operations import names_no_task_has

    for note in names_no_task_has(engine, flt):
        click.echo(f"note: {note}", err=True)


def _act(verb: str, done: str, yes: bool, by: str | None, given: dict[str, Any]) -> None:
    from balancer.backlog import operations
    from balancer.storage.audit import default_actor

    flt = _filter(**given)
    act = operations.retry_failed_or_cancelled if verb == "retry" else operations.cancel_pending
    svc = _migrated()
    ids = act(svc.engine, flt, by=by or default_actor(), apply=yes)
    if not ids:
        _say_what_matched_nothing(svc.engine, flt)
    if verb == "retry" and (too_large := operations.still_too_large(svc.engine, ids,
                                                                    {q.name: q.burst for q in svc.quotas.all()})):
        click.echo(f"note: {too_large} of them need more tokens than any of their models' burst_tokens: they fail "
                   "again at once (raise a model's --burst first)", err=True)
    preview = ", ".join(map(str, ids[:20])) + (" ..." if len(ids) > 20 else "")
    if not yes:
        click.echo(f"would {verb} {len(ids)} task(s){': ' + preview if ids else ''} (dry run: pass --yes to apply)")
        return
    click.echo(f"{done} {len(ids)} task(s){': ' + preview if ids else ''}")
    if ids and verb == "retry":
        from balancer.cli.quota import warn_stranded

        warn_stranded(svc)
        _ask_for_dispatch()


def changing(statuses: str) -> Any:
    """The options of a command that changes only tasks of the ``statuses`` said: the filters, --yes and --by."""
    def options(command: Any) -> Any:
        command = click.option("--by", help="Who acts (default: the OS user), for the audit.")(command)
        command = click.option("--yes", is_flag=True,
                               help="Apply (without it: a dry run that lists what would change).")(command)
        return filters(command, statuses)
    return options


@tasks.command("retry")
@changing("failed (default) or cancelled")
def tasks_retry(yes: bool, by: str | None, **given: Any) -> None:
    """Failed tasks back to pending, attempts reset; cancelled ones instead when the status
    given is cancelled (how a cancelled task's row in a source table is asked again)."""
    _act("retry", "retried", yes, by, given)


@tasks.command("cancel")
@changing("pending (the only status it changes)")
def tasks_cancel(yes: bool, by: str | None, **given: Any) -> None:
    """Pending tasks out of the backlog (status cancelled)."""
    _act("cancel", "cancelled", yes, by, given)


@tasks.command("prune")
@click.option("--before", required=True, type=click.DateTime(),
              help="UTC: delete finished tasks last changed before this, e.g. 2026-11-01")
@click.option("--yes", is_flag=True, help="Apply (without it: a dry run that counts what would be deleted).")
@click.option("--by", help="Who acts (default: the OS user), for the audit.")
def tasks_prune(before: datetime, yes: bool, by: str | None) -> None:
    """Delete solved, failed and cancelled tasks last changed before --before
    (never a pending, ready, queued or running one, nor one whose write-back to its
    source's table has not ended: those are counted as kept); audited, batch by batch."""
    from balancer.backlog.retention import kept_for_writeback, prune
    from balancer.storage.audit import default_actor

    when = before.replace(tzinfo=UTC) if before.tzinfo is None else before
    engine = _migrated().engine
    n = prune(engine, when, by=by or default_actor(), apply=yes)
    kept = kept_for_writeback(engine, when)
    kept_text = (f"; kept {kept} whose write-back to their source's table has not ended (balancer source list)"
                 if kept else "")
    if not yes:
        click.echo(f"would delete {n} finished task(s) last changed before {when:%Y-%m-%d %H:%M:%S} UTC"
                   f"{kept_text.replace('; kept', '; would keep')} (dry run: pass --yes to apply)")
        return
    click.echo(f"deleted {n} finished task(s) last changed before {when:%Y-%m-%d %H:%M:%S} UTC{kept_text}")

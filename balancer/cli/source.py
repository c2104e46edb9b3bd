"""``balancer source ...``: declare the team's own tables as sources (see
:mod:`balancer.sources.definition` for the file's format)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from balancer.cli.import_export import echo_changes, read_declared, write_text
from balancer.cli.source_unwritable import unwritable_command
from balancer.cli.source_weight import set_command
from balancer.cli.startwait import migrated
from balancer.errors import BalancerError, printable


@click.group()
def source() -> None:
    """Source tables: rows of the team's PostgreSQL table in, answers written back."""


source.add_command(set_command)
source.add_command(unwritable_command)


@source.command("rows")
@click.argument("name")
@click.option("--limit", default=200, show_default=True, type=click.IntRange(1, 1_000_000), help="At most this many rows.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def source_rows(name: str, limit: int, as_json: bool) -> None:
    """The rows of source NAME that hold no answer from balancer, by their key, and why: not a task
    (its reason), cancelled, or a write-back waiting after a failed try, not overwritten or
    unwritable (the counts of `source list`, row by row), or a failed task with no column to write."""
    import sqlalchemy as sa

    from balancer.sources.schema import sources
    from balancer.sources.unanswered import unanswered

    svc = migrated()
    with svc.engine.connect() as conn:
        if conn.execute(sa.select(sources.c.name).where(sources.c.name == name)).first() is None:
            raise BalancerError(f"no source {printable(name, 80)!r} (balancer source list)")
    rows = unanswered(svc.engine, name, limit)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows]))
        return
    for r in rows:
        task = f" (balancer task {r.task_id})" if r.task_id is not None else ""
        click.echo(printable(f"key {r.key}{task}: {r.why}", limit=600))
    more = " (--limit reached: there may be more)" if len(rows) == limit else ""
    click.echo(printable(f"{name}: {len(rows)} row(s) without balancer's answer{more}"))


@source.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--replace", is_flag=True, help="Also remove the sources FILE does not list.")
@click.option("--dry-run", is_flag=True, help="Check FILE against each database and print what would change; change nothing.")
@click.option("--by", help="Who made the change (default: the OS user), for the audit.")
def source_import(file: Path, replace: bool, dry_run: bool, by: str | None) -> None:
    """Create or update the sources in FILE (TOML), each checked against its table's catalog first."""
    from balancer.sources.batchwrite import check_writable
    from balancer.sources.catalog import check_source, poll_note, read_only, team_connection
    from balancer.sources.definition import SourceFileError, parse_source_file
    from balancer.sources.read_errors import clear_read_errors
    from balancer.sources.store import import_sources
    from balancer.sources.tables import check_option_note
    from balancer.storage.audit import default_actor

    name, definitions = read_declared(file, parse_source_file)
    if not definitions and not replace:
        raise BalancerError(f"{name} lists no sources")
    svc = migrated()
    known = {q.name for q in svc.quotas.all()}
    for definition in definitions:  # as submit refuses a task for a model with no quota: its rows would never run
        if unknown := [m for m in definition.models or () if m not in known]:
            raise SourceFileError(f"{name}: sources.{definition.name}.models: no model has the name "
                                  f"{printable(', '.join(unknown), 200)} (add its quota first: `balancer quota set NAME --create` "
                                  "or `balancer quota import FILE`)")
    relations = {}  # the tables each reads, whatever its spelling: one table is one source
    notes = []
    for definition in definitions:
        with team_connection(definition, svc.engine) as conn:
            try:
                relations[definition.name] = check_source(conn, definition)
                check_writable(conn, definition)
            except SourceFileError as exc:  # FILE's mistake: named as read_declared names its own
                raise SourceFileError(f"{name}: {exc}") from None
            notes.append(poll_note(conn, definition))  # a poll that cannot use an index (issue 38 finding 11)
            with read_only(conn):
                notes.append(check_option_note(conn, definition))  # a view that may refuse each write-back
    summary = import_sources(svc.engine, definitions, by=by or default_actor(), replace=replace, dry_run=dry_run,
                             relations=relations)
    if not dry_run:
        clear_read_errors(svc.redis, svc.settings.namespace, summary.removed)
    echo_changes(summary, f"{len(definitions)} source(s)", name, dry_run, replace)
    for note in notes:
        if note:
            click.echo(note)


@source.command("export")
@click.argument("file", required=False, type=click.Path(dir_okay=False, path_type=Path))
def source_export(file: Path | None) -> None:
    """Write every source as TOML to FILE (default: stdout)."""
    from balancer.sources.definition import format_source_file
    from balancer.sources.store import all_sources

    with migrated().engine.connect() as conn:
        text = format_source_file(all_sources(conn))
    write_text(file, text)


@source.command("list")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def source_list(as_json: bool) -> None:
    """Every source: its table, its tasks by state, write-backs waiting and the cursor's lag;
    and every other source (JSONL, the inbox) with a weight or a budget per day set: the weight,
    what it spent today and whether its tasks wait."""
    from balancer.dispatch.budgets import read_standings
    from balancer.sources.read_errors import read_errors
    from balancer.sources.reads import source_status
    from balancer.sources.store import all_sources
    from balancer.sources.weights import DEFAULT_WEIGHT, weights

    svc = migrated()
    with svc.engine.connect() as conn:
        definitions = {d.name: d for d in all_sources(conn)}
        weighted = weights(conn)
    rows = source_status(svc.engine)
    budgets = read_standings(svc)
    unreadable = read_errors(svc.redis, svc.settings.namespace, definitions)  # its last read's error, as status shows it
    others = sorted((budgets.keys() | weighted.keys()) - definitions.keys())  # JSONL and inbox sources
    if as_json:
        listed = [{**definitions[r.name].as_dict(), **r.as_dict(),
                   "budget": budgets[r.name].as_dict() if r.name in budgets else None,
                   "read_error": unreadable.get(r.name)}
                  for r in rows if r.name in definitions]
        click.echo(json.dumps(listed + [{"name": name, "weight": weighted.get(name, DEFAULT_WEIGHT),
                                         "budget": budgets[name].as_dict() if name in budgets else None}
                                        for name in others]))
        return
    for r in rows:
        d = definitions.get(r.name)
        if d is None:
            continue
        where = d.database_url_env or "balancer's database"
        budget = f"; budget {budget_line(budgets[r.name])}" if r.name in budgets else ""
        error = f"; table unreadable: {unreadable[r.name]}" if r.name in unreadable else ""
        click.echo(printable(f"{r.name}: {d.table} ({where}) key {d.key}, weight {d.weight}; {source_line(r)}{budget}"
                             f"{error}", limit=600))
    for name in others:
        said = ([f"weight {weighted[name]}"] if name in weighted else []) + \
            ([f"budget {budget_line(budgets[name])}"] if name in budgets else [])
        click.echo(printable(f"{name}: {'; '.join(said)}", limit=400))


def source_line(r) -> str:  # noqa: ANN001 - a storage.source_reads.SourceStatus
    """One source's counts, as ``status`` and ``source list`` print them."""
    lag = "never read to its end" if r.lag_s is None else f"{r.lag_s:g} s"
    unwritable = f" (last: {r.unwritable_error})" if r.unwritable and r.unwritable_error else ""
    failing = (f" ({r.writebacks_failing} failing, retried; last: {r.writebacks_failing_error})"
               if r.writebacks_failing else "")
    return printable(f"pending {r.pending}, in flight {r.in_flight}, solved {r.solved}, failed {r.failed}, "
                     f"cancelled {r.cancelled}, write-backs waiting {r.writebacks_waiting}{failing}, not overwritten {r.conflicts}, "
                     f"prompt changed (asked again) {r.changed}, unwritable {r.unwritable}{unwritable}, "
                     f"cursor lag {lag}{not_tasks_text(r.not_tasks)}", limit=800)


def not_tasks_text(not_tasks: dict[str, int]) -> str:
    """The rows of work that are not tasks, by reason, as ``status`` and ``source list`` append them.

    >>> not_tasks_text({"NULL key": 2, "empty prompt": 1}), not_tasks_text({})
    ('; rows not tasks 3 (NULL key 2, empty prompt 1)', '')
    """
    return f"; rows not tasks {not_tasks_count(not_tasks)}" if not_tasks else ""


def not_tasks_count(not_tasks: dict[str, int]) -> str:
    """How many rows of work are not tasks, and why, as ``top`` and the console show them.

    >>> not_tasks_count({"NULL key": 2, "empty prompt": 1}), not_tasks_count({})
    ('3 (NULL key 2, empty prompt 1)', '0')
    """
    if not not_tasks:
        return "0"
    return f"{sum(not_tasks.values())} ({', '.join(f'{reason} {n}' for reason, n in not_tasks.items())})"


def budget_line(b) -> str:  # noqa: ANN001 - a costs.budget.Standing
    """One source's budget per day, as ``status`` and ``source list`` print it.

    >>> from balancer.costs.budget import Budget, Standing
    >>> budget_line(Standing(Budget("crm", 5.0), 10, 5.2, 0, "USD"))
    '5.00 USD per day; waiting: budget spent (5.20 of 5.00 USD today)'
    >>> budget_line(Standing(Budget("crm", None, 100), 10, 0.0, 0, None))
    '100 tokens per day; spent 10 of 100 tokens today'
    """
    return f"{b.budget.text(b.currency)}; {b.waiting() or 'spent ' + b.spent_text()}"


@source.command("remove")
@click.argument("name")
@click.option("--cancel", is_flag=True,
              help="Remove it now: cancel its pending tasks and drop its waiting write-backs (its tasks in flight "
                   "end without one). Without it, removal is refused while any of them is left.")
@click.option("--by", help="Who made the change (default: the OS user), for the audit.")
def source_remove(name: str, cancel: bool, by: str | None) -> None:
    """Stop reading NAME (its tasks stay; its table is not touched). Refused, with the counts, while
    it has tasks not ended or write-backs waiting, unless --cancel; importing it again resumes them."""
    from balancer.sources.read_errors import clear_read_errors
    from balancer.sources.store import remove_source
    from balancer.storage.audit import default_actor

    svc = migrated()
    done = remove_source(svc.engine, name, by=by or default_actor(), cancel=cancel)
    clear_read_errors(svc.redis, svc.settings.namespace, [name])
    if not done:
        click.echo(f"{printable(name)}: removed")
        return
    click.echo(f"{printable(name)}: removed; cancelled {len(done['cancelled_tasks'])} pending task(s), dropped "
               f"{len(done['dropped_writebacks'])} waiting write-back(s); {done['in_flight']} task(s) in flight end "
               "without a write-back (importing it again resumes them)")

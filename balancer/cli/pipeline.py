"""Pipeline commands: submit, top, demo, bench, and the helpers ``status`` (:mod:`balancer.cli.status`)
shares with ``top`` (``drain_text``, ``model_table``); the long-running processes' commands
(worker, dispatcher, beat, sim, metrics, router) are in :mod:`balancer.cli.processes`."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from balancer.cli.startwait import migrated as _migrated
from balancer.errors import BalancerError, QuotaError, printable


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--strict", is_flag=True, help="Accept nothing if any line is bad.")
@click.option("--source", default="submit", show_default=True, help="Source recorded on tasks without one.")
def submit(file: Path, strict: bool, source: str) -> None:
    """Insert the tasks in FILE (JSONL, one {"prompt": ...} per line).

    A task whose (source, key) is already stored is not inserted again and is
    counted as already present. Exit 0: every line accepted or already
    present. Exit 3: valid lines accepted, bad ones
    listed. Exit 2: nothing accepted (bad file, or --strict with a bad line).
    """
    from balancer.backlog.insert import insert_tasks
    from balancer.backlog.intake import LineError, TaskRow, batches, check_source, parse_stream
    from balancer.sources.store import intake_rules

    try:  # read as a stream, a batch of lines at a time: memory does not grow with the file
        stream = sys.stdin.buffer if str(file) == "-" else file.open("rb")
    except OSError as exc:
        raise BalancerError(f"cannot read {printable(str(file))}: {exc.strerror or exc}") from None
    svc = _migrated()
    models = {q.name: q.burst for q in svc.quotas.all()}
    if not models:
        raise QuotaError("no models are configured: add quotas first (`balancer quota import FILE`)")
    accepted = present = errors = 0
    with stream, svc.engine.begin() as conn:  # one transaction: all valid lines, or none
        rules = intake_rules(conn, svc.settings)  # no table source's name, prompts and names within their limits
        try:
            check_source(source, rules)
        except ValueError as exc:
            raise BalancerError(f"--source: {exc}") from None
        items = parse_stream(stream, models=models, default_max_tokens=svc.settings.expected_output_tokens,
                             default_source=source, rules=rules)
        try:
            for batch in batches(items, 1000):
                bad = [item for item in batch if isinstance(item, LineError)]
                for error in bad:
                    click.echo(f"{printable(str(file))}:{error}", err=True)
                errors += len(bad)
                if not (errors and strict):
                    rows = [item for item in batch if isinstance(item, TaskRow)]
                    inserted = len(insert_tasks(conn, rows, dedup=svc.settings.dedup))  # a keyed task already present is skipped
                    accepted, present = accepted + inserted, present + len(rows) - inserted
        except OSError as exc:
            raise BalancerError(f"cannot read {printable(str(file))}: {exc.strerror or exc}") from None
        if errors and strict:  # (raising inside the transaction rolls it back)
            raise BalancerError(f"{errors} bad line(s); --strict: nothing accepted")
        if not accepted and not present:
            raise BalancerError(f"no valid tasks in {printable(str(file))}" + (f" ({errors} bad line(s))" if errors else ""))
    click.echo(f"accepted {accepted} task(s)" + (f", already present {present}" if present else "")
               + (f", rejected {errors} line(s)" if errors else ""))
    if accepted:
        _ask_for_dispatch()
    if errors:
        raise SystemExit(3)


def _ask_for_dispatch() -> None:
    """Ask the dispatcher to run now rather than at beat's next tick (or never,
    if beat is down). The tasks are already stored, so failing to ask is only
    a warning: any later tick or freed slot dispatches them."""
    from balancer.pipeline.tasks import trigger_dispatch

    try:
        trigger_dispatch()
    except Exception as exc:  # noqa: BLE001 - the tasks are stored; this is best effort
        click.echo(f"warning: could not ask for a dispatch now ({type(exc).__name__}); "
                   "the dispatcher's next tick will take the tasks", err=True)



def eta_text(eta: float | None) -> str:
    """The drain ETA for a person: ``4 min 05 s``, ``done`` or ``unknown``.

    >>> eta_text(245.2), eta_text(0.0), eta_text(None)
    ('4 min 05 s', 'done', 'unknown')
    """
    if eta is None:
        return "unknown"
    if eta <= 0:
        return "done"
    minutes, seconds = divmod(round(eta), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def band_text(drain: Any) -> str:
    """The ETA's band for a person, after the ETA: `` (3 min 10 s to 4 min 40 s)``; empty when done or unknown.

    >>> from balancer.views.eta import Forecast
    >>> band_text(Forecast(245.0, 190.0, 280.0)), band_text(Forecast(0.0, 0.0, 0.0)), band_text(None)
    (' (3 min 10 s to 4 min 40 s)', '', '')
    """
    if drain is None or drain.eta is None or drain.eta <= 0 or drain.low is None or drain.high is None:
        return ""
    return f" ({eta_text(max(drain.low, 0.5))} to {eta_text(drain.high)})"


def counted_since(old: dict, new: dict, model: str, *fields: str) -> float:
    """What ``model``'s counters ``fields`` grew by from ``old`` to ``new``: ``top``'s tokens and requests of the
    last minute (of its own first minute, until it has seen one), never scaled up from a shorter look, so a
    burst seen over a few seconds does not read as a minute's rate above the quota (an operator's probe read
    5,776 against 2,000 + 400).

    >>> counted_since({"m": {"solved": 3, "failed": 1}}, {"m": {"solved": 9, "failed": 1}}, "m", "solved", "failed")
    6
    """
    return sum(new.get(model, {}).get(f, 0) - old.get(model, {}).get(f, 0) for f in fields)


def drain_text(drain: Any, blocked: str | None = None, unread: Sequence[str] = (), not_yet_read: Sequence[str] = (),
               after_the_end: int = 0, unwritten: Sequence[str] = ()) -> str:
    """The ETA, its band, and what it leaves out: pending tasks whose source's budget is spent, or that no
    enabled model may take, the rows of the ``unread`` sources (their table could not be read) and of the
    ``not_yet_read`` ones (readable, never read to the end of their table: some rows are not tasks yet),
    and the answers of the ``unwritten`` sources (their write-backs fail and are retried);
    ``blocked`` (why nothing can run: :func:`balancer.health.reasons.blocked`) instead of a number.

    >>> from balancer.views.eta import Forecast
    >>> drain_text(Forecast(245.0, 190.0, 280.0)), drain_text(Forecast(0.0, 0.0, 0.0))
    ('4 min 05 s (3 min 10 s to 4 min 40 s)', 'done')
    >>> drain_text(Forecast(245.0, 190.0, 280.0, waiting=40))
    '4 min 05 s (3 min 10 s to 4 min 40 s); 40 pending task(s) wait on a budget, not in the eta'
    >>> drain_text(Forecast(0.0, 0.0, 0.0, waiting=40))
    'nothing else to run; 40 pending task(s) wait on a budget, not in the eta'
    >>> drain_text(Forecast(0.0, 0.0, 0.0, unplaced=6))
    'nothing else to run; 6 pending task(s) may take only models removed, disabled or stopped (health), not in the eta'
    >>> drain_text(Forecast(1.0, 1.0, 1.0), "blocked: m: backend unreachable: refused")
    'blocked: m: backend unreachable: refused'
    >>> drain_text(Forecast(0.0, 0.0, 0.0), unread=["questions"])   # not "done": its rows were not read
    'nothing else to run; the rows of source questions (its table could not be read), not in the eta'
    >>> drain_text(Forecast(0.0, 0.0, 0.0), not_yet_read=["questions"])   # a source imported, not read yet
    'nothing else to run; the rows of source questions (not read to its end yet), not in the eta'
    >>> drain_text(Forecast(0.0, 0.0, 0.0), unwritten=["crm"])   # not "done": the team's table lacks answers
    'nothing else to run; the answers of source crm wait to be written back (failing, retried: see its health)'
    >>> drain_text(Forecast(0.0, 0.0, 0.0), after_the_end=2)   # calls_after_the_end: why a model still shows calls
    "done; 2 call(s) of finished tasks still run at the backend (a hedge's loser runs to its end; its slot frees then)"
    """
    if blocked:
        return blocked
    waiting, unplaced = (0, 0) if drain is None else (drain.waiting, drain.unplaced)
    eta = None if drain is None else drain.eta
    aside = ([f"{waiting} pending task(s) wait on a budget"] if waiting else []) + \
        ([f"{unplaced} pending task(s) may take only models removed, disabled or stopped (health)"] if unplaced else []) + \
        [f"the rows of source {name} (its table could not be read)" for name in unread] + \
        [f"the rows of source {name} (not read to its end yet)" for name in not_yet_read]
    text = "nothing else to run" if (aside or unwritten) and eta is not None and eta <= 0 \
        else eta_text(eta) + band_text(drain)
    text += "".join(f"; {said}, not in the eta" for said in aside)
    text += "".join(f"; the answers of source {name} wait to be written back (failing, retried: see its health)"
                    for name in unwritten)
    if after_the_end:
        from balancer.views.summary import after_the_end_text

        text += f"; {after_the_end_text(after_the_end)}"
    return text


#: Below this many columns ``top`` leaves out the bucket levels and answered counts, so each row keeps to one line.
WIDE = 140
#: The column titles on two lines, below WIDE.
NARROW_HEADERS = {"in flight": "in\nflight", "tokens/min / TPM + burst": "tokens/min\n/ TPM+burst",
                  "requests/min / RPM + burst": "requests/min\n/ RPM+burst", "p50/p99 s (~prior)": "p50/p99 s\n(~ prior)"}


def model_table(rows: list, rates: dict[str, tuple[float, float]] | None = None, width: int = WIDE):  # noqa: ANN202
    """The per-model table of ``status`` and ``top`` (``rates``: tokens and requests per minute, for top,
    each against what the quota allows in 60 s: the rate plus its burst); narrower than :data:`WIDE`
    columns, the bucket levels and answered counts are left out."""
    from rich import box
    from rich.table import Table

    narrow = width < WIDE
    table = Table(title="models", box=box.MINIMAL_HEAVY_HEAD if narrow else box.HEAVY_HEAD, pad_edge=not narrow,
                  show_edge=not narrow, padding=(0, 0 if narrow else 1))
    learned = any(r.learned for r in rows) and not narrow  # limits in force below the quota, when a model has them
    columns = ["model", "in flight", "tokens now / bucket", "requests now", "429s", "answered", "p50 / p99 s", "binds"]
    columns += ["learned limits (in force / quota)"] if learned else []
    if rates is not None:
        columns[3:3] = ["tokens/min / TPM + burst", "requests/min / RPM + burst"]
    if narrow:  # each row on one line: fewer columns, no cell wrapped, the prior's latency marked ~
        columns = [c if c != "p50 / p99 s" else "p50/p99 s (~prior)" for c in columns
                   if c not in ("tokens now / bucket", "requests now", "answered")]
    for i, col in enumerate(columns):
        header = NARROW_HEADERS.get(col, col) if narrow else col
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=i == 0 or narrow)
    for r in rows:
        cells = {
            "model": r.name, "in flight": f"{r.in_flight}/{r.cap}", "tokens now / bucket": f"{r.tokens_available:,.0f} / {r.bucket:,.0f}",
            "requests now": "-" if r.requests_available is None else f"{r.requests_available:,.1f}",
            "429s": str(r.rate_limited), "answered": str(r.solved),
            "p50 / p99 s": f"{r.p50_s:g} / {r.p99_s:g}" + ("" if r.latency_measured else " (prior)"),
            "p50/p99 s (~prior)": ("" if r.latency_measured else "~") + f"{r.p50_s:g}/{r.p99_s:g}",
            "binds": r.binding, "learned limits (in force / quota)": r.learned_cell(),
        }
        if rates is not None:
            cells["tokens/min / TPM + burst"], cells["requests/min / RPM + burst"] = r.allowance_cells(
                *rates.get(r.name, (0.0, 0.0)), short=narrow)
        table.add_row(*(cells[c] for c in columns))
    return table


def health_lines(health: Any) -> list[str]:
    """One line per model and per source with a reason (``status``, ``top``), each a person can act on.

    >>> from balancer.health.reasons import ModelFacts, SourceFacts, assess
    >>> health_lines(assess([ModelFacts("a", paused_s=3), ModelFacts("b")], [SourceFacts("s", read_error="gone")], 1))
    ['health a: paused by a 429 for 3.0 s more', 'health source s: table unreadable: gone']
    """
    lines = [f"health {name}: {'; '.join(r.text for r in reasons)}" for name, reasons in health.models.items() if reasons]
    lines += [f"health source {name}: {'; '.join(r.text for r in reasons)}" for name, reasons in health.sources.items()]
    return [printable(line, limit=400) for line in lines]


def _source_table(sources: list, weights: dict[str, int], budgets: dict, default_weight: int):  # noqa: ANN202
    """``top``'s per-source table: each source table's tasks by state, as ``status`` reads them
    (``sources.reads.SourceStatus``), its weight, and its budget per day and whether its tasks wait
    (``costs.budget.Standing``), its rows of work that are not tasks and why; a source with a budget
    and no table, its weight and budget alone."""
    from rich.table import Table

    from balancer.cli.source import budget_line, not_tasks_count

    table = Table(title="sources")
    for i, col in enumerate(("source", "pending", "in flight", "solved", "failed", "cancelled", "weight",
                             "budget per day", "rows not tasks")):
        table.add_column(col, justify="left" if i in (0, 7, 8) else "right", no_wrap=i == 0)
    counts = {s.name: [str(n) for n in (s.pending, s.in_flight, s.solved, s.failed, s.cancelled)] for s in sources}
    not_tasks = {s.name: printable(not_tasks_count(s.not_tasks), limit=400) for s in sources}
    for name in sorted(counts.keys() | budgets.keys()):
        table.add_row(printable(name), *counts.get(name, ["-"] * 5), str(weights.get(name, default_weight)),
                      printable(budget_line(budgets[name]), limit=400) if name in budgets else "-",
                      not_tasks.get(name, "-"))
    return table


@click.command()
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.1, 60), help="Seconds between refreshes.")
@click.option("--count", type=click.IntRange(1), help="Stop after this many refreshes (default: until Ctrl-C).")
def top(interval: float, count: int | None) -> None:
    """A live view: per model, calls in flight against the cap, tokens and
    requests per minute against TPM and RPM (over the last minute this view
    has seen), 429s, latency and the binding limit; per source table (and source with a budget per
    day): its tasks by state, weight and budget; the backlog below. Piped or redirected, each
    refresh is printed after the last."""
    import contextlib
    import time
    from collections import deque

    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    from balancer.costs.cost import projection_text, spend_text
    from balancer.sources.reads import source_status
    from balancer.sources.weights import DEFAULT_WEIGHT, weights
    from balancer.views.overview import read_overview
    from balancer.views.summary import calls_after_the_end

    svc = _migrated()
    seen: deque[tuple[float, dict[str, dict[str, int]]]] = deque()

    def frame() -> Group:
        o = read_overview(svc)
        counts, rows, counters, drain, budgets = o.counts, o.rows, o.counters, o.drain, o.budgets
        now = time.monotonic()
        seen.append((now, counters))
        while len(seen) > 1 and now - seen[0][0] > 60:
            seen.popleft()
        old = seen[0][1]
        rates = {r.name: (counted_since(old, counters, r.name, "tokens_estimated"),
                          counted_since(old, counters, r.name, "solved", "transient", "failed")) for r in rows}
        sources = source_status(svc.engine)
        eta = drain_text(drain, o.health.blocked, o.health.unread_sources, o.not_read, calls_after_the_end(counts, rows),
                         o.health.writeback_failing_sources)
        counted = Text("  ".join(f"{k}: {v}" for k, v in counts.items()) + f"  eta: {eta}")
        money = [Text(spend_text(o.spent)), Text(projection_text(o.projected))]
        with svc.engine.connect() as conn:
            shares = weights(conn)
        by_source = [_source_table(sources, shares, budgets, DEFAULT_WEIGHT)] if sources or budgets else []
        health = [Text(line) for line in health_lines(o.health)]
        return Group(model_table(rows, rates, console.width), *health, *by_source, counted, *money)

    console = Console()  # the terminal's width: a wider one than the terminal makes rows wrap and frames pile up
    # Piped or redirected, there is no live view: each refresh is printed after the last, as `top -b` does.
    live = Live(console=console, auto_refresh=False) if console.is_terminal else contextlib.nullcontext()
    with live, contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how top ends: exit 0, not "aborted"
        shown = 0
        while count is None or shown < count:
            if shown:
                time.sleep(interval)
            if isinstance(live, Live):
                live.update(frame(), refresh=True)
            else:
                console.print(frame())
            shown += 1


@click.command()
@click.option("--tasks", "count", default=500, show_default=True, type=click.IntRange(1, 1_000_000),
              help="How many prompts to solve.")
@click.option("--models", default=10, show_default=True, type=click.IntRange(1, 100), help="How many simulated models.")
@click.option("--time-scale", default=0.1, show_default=True, type=click.FloatRange(min=0.001),
              help="Latencies and per-minute windows x this.")
@click.option("--seed", default=1, show_default=True, help="Seed of the prompts and the simulator's draws.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary as the last line.")
def demo(count: int, models: int, time_scale: float, seed: int, as_json: bool) -> None:
    """Try it: solve a backlog through the simulator, live, within every quota, on embedded services (or on
    the ones BALANCER_REDIS_URL and BALANCER_DATABASE_URL name, in a namespace and schema of its own)."""
    from balancer.devtools.demo import run_demo

    summary = run_demo(tasks=count, model_count=models, time_scale=time_scale, seed=seed, quiet=as_json)
    if as_json:
        click.echo(json.dumps(summary))


@click.command()
@click.argument("scenario")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Report directory [default: ./bench-out/<scenario>-<time>].")
@click.option("--only", type=click.Choice(["pipeline", "baseline"]), help="Run just one side.")
@click.option("--quota-accounting", type=click.Choice(["reserve", "settle"]),
              help="Ablation: give every balancer quota this token_accounting, whatever the simulated provider does.")
@click.option("--worker-layout", type=click.Choice(["one", "per-model"]),
              help="Pipeline workers: every pool in one process (default), or one process per model.")
@click.option("--compare-greedy", is_flag=True,
              help="Also run the pipeline with the end game and hedging off, same seed: before and after in one run.")
@click.option("--compare-hedging", is_flag=True,
              help="Run the pipeline with hedging off, then on, same seed; report what hedging cost in tokens and money.")
def bench(scenario: str, out: Path | None, only: str | None, quota_accounting: str | None, worker_layout: str | None,
          compare_greedy: bool, compare_hedging: bool) -> None:
    """Benchmark SCENARIO (a bundled name such as `short`, or a TOML file):
    the pipeline against today's Airflow pattern and the capacity bound."""
    import time

    from balancer.bench.compare.run import main as run_bench
    from balancer.bench.scenarios import locate

    name, _ = locate(scenario)  # a bad name fails here, in one line, before anything starts
    if out is None:
        out = Path("bench-out") / f"{name.removesuffix('.toml')}-{time.strftime('%Y%m%d-%H%M%S')}"
    click.echo(f"writing the report to {out.resolve()}", err=True)
    if compare_hedging:
        from balancer.bench.compare.hedging import main as run_hedging

        run_hedging(scenario, out, worker_layout)
        return
    run_bench(scenario, out, only, quota_accounting, worker_layout, compare_greedy)


"""Pipeline commands: submit, worker, dispatcher, beat, sim, demo, status."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import click

from balancer.cli import resolved_settings, services
from balancer.errors import BalancerError, ConfigError, QuotaError, printable


def _migrated(*, wait: bool = False):  # noqa: ANN202
    """Connected services on a migrated schema. ``wait``: a long-running process's
    start, which waits for an unreachable Redis or PostgreSQL (``BALANCER_START_WAIT``)."""
    from balancer.storage.migrate import require_migrated

    def start():  # noqa: ANN202
        svc = services()
        require_migrated(svc.engine)
        return svc

    if not wait:
        return start()
    from balancer.cli.startwait import wait_until_reachable

    return wait_until_reachable(start, resolved_settings().start_wait)


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
    from balancer.domain.intake import LineError, TaskRow, batches, parse_stream
    from balancer.storage.intake import insert_tasks

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
        items = parse_stream(stream, models=models, default_max_tokens=svc.settings.expected_output_tokens,
                             default_source=source)
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


def _celery_worker(argv: list[str], pool: str, *, all_models: bool = False) -> None:
    import balancer.pipeline.tasks  # noqa: F401 - registers tasks and the quota watcher
    from balancer.pipeline.app import app

    # A class path is accepted by the worker_pool setting, not by `-P` (a fixed choice list).
    app.conf.worker_pool = pool
    app.conf.balancer_all_models = all_models  # the quota watcher adds queues of models created later
    # Not app.worker_main (nor app.start), which drop the exit code that click's
    # non-standalone main returns: after an "Unrecoverable error" the process
    # would exit 0, and a restart-on-failure supervisor (compose, systemd)
    # would leave it down. This is app.start, keeping the code.
    from celery.bin.celery import celery

    celery.params[0].default = app
    try:
        code = celery.main(args=argv, standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    finally:
        celery.params[0].default = None
    if code:
        raise SystemExit(code)


@click.command()
@click.option("--model", "models", multiple=True, help="Model whose queue model.<name> to consume (repeatable).")
@click.option("--all-models", is_flag=True, help="Consume every configured model's queue in one process.")
@click.option("--loglevel", default="INFO", show_default=True)
def worker(models: tuple[str, ...], all_models: bool, loglevel: str) -> None:
    """A worker pool for one or more models, sized to their max_concurrent_requests."""
    svc = _migrated(wait=True)
    known = {q.name: q for q in svc.quotas.all()}
    chosen = sorted(known) if all_models else list(models)
    if not chosen:
        raise BalancerError("give --model NAME (repeatable) or --all-models")
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise QuotaError(f"unknown model(s): {', '.join(unknown)}")
    concurrency = sum(known[m].max_concurrent_requests for m in chosen)
    queues = ",".join(f"model.{m}" for m in chosen)
    name = "models" if all_models else "+".join(chosen)
    # The pid keeps node names unique when several processes share a host
    # (RabbitMQ's exclusive pidbox queue refuses a second node of the same name).
    _celery_worker([
        "worker", "-Q", queues, "-c", str(concurrency),
        "-n", f"{name[:50]}-{os.getpid()}@%h", "--without-gossip", "--without-mingle", "-l", loglevel,
    ], pool="balancer.pipeline.pool:ResizableThreadPool", all_models=all_models)


@click.command()
@click.option("--loglevel", default="INFO", show_default=True)
def dispatcher(loglevel: str) -> None:
    """The dispatcher: consumes the control queue (dispatch, ingest, sweep)."""
    _migrated(wait=True)
    _celery_worker([
        "worker", "-Q", "control", "-c", "2", "-n", f"dispatcher-{os.getpid()}@%h",
        "--without-gossip", "--without-mingle", "-l", loglevel,
    ], pool="threads")


@click.command()
@click.option("--loglevel", default="INFO", show_default=True)
def beat(loglevel: str) -> None:
    """Celery beat: periodic dispatch, sweep and ingest ticks."""
    home = Path(resolved_settings().home)  # exports the URLs before the app reads celeryconfig
    from balancer.cli.startwait import wait_until_reachable

    wait_until_reachable(services, resolved_settings().start_wait)  # its ticks need both: wait, not crash-loop
    from balancer.pipeline.app import app

    home.mkdir(parents=True, exist_ok=True)
    app.Beat(loglevel=loglevel, schedule=str(home / "celerybeat-schedule")).run()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8900, show_default=True, type=click.IntRange(1, 65535))
@click.option("--models", "count", default=10, show_default=True, type=click.IntRange(1, 100), help="How many default models.")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.0001),
              help="Multiplies latencies and per-minute windows.")
@click.option("--error-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1))
@click.option("--accounting", type=click.Choice(["reserve", "settle"]), default="reserve", show_default=True,
              help="How the default models count tokens: reserve (kept, strict) or settle (unused part refunded).")
@click.option("--seed", default=0, show_default=True)
@click.option("--grace", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds of refill tolerated above the buckets (0: strict, as providers are).")
@click.option("--log", "log_path", type=click.Path(dir_okay=False, path_type=Path), help="Append every call to this JSONL file.")
@click.option("--scenario", help="Take models and time scale from a scenario (bundled name or TOML file).")
def sim(host: str, port: int, count: int, time_scale: float, error_rate: float, accounting: str, seed: int, grace: float,
        log_path: Path | None, scenario: str | None) -> None:
    """Run the simulated Models Backend."""
    import dataclasses

    import uvicorn

    from balancer.devtools.sim.config import default_models
    from balancer.devtools.sim.server import Simulator, create_app

    if scenario is not None:
        from balancer.bench.scenarios import locate
        from balancer.devtools.scenario import parse_scenario

        file_name, text = locate(scenario)
        spec = parse_scenario(text, file_name)
        models, time_scale, count = list(spec.models), spec.time_scale, len(spec.models)
    else:
        models = [dataclasses.replace(m, error_rate=error_rate, accounting=accounting) for m in default_models(count)]
    simulator = Simulator(models, time_scale=time_scale, seed=seed, grace=grace, log_path=log_path)
    click.echo(f"simulated Models Backend on http://{host}:{port} ({count} models, time scale {time_scale})", err=True)
    uvicorn.run(create_app(simulator), host=host, port=port, log_level="warning", backlog=4096)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 to expose it).")
@click.option("--port", default=9808, show_default=True, type=click.IntRange(1, 65535))
@click.option("--finished-every", default=60.0, show_default=True, type=click.FloatRange(0, 86_400),
              help="Seconds between recounts of solved, failed and cancelled tasks (they read the whole history).")
def metrics(host: str, port: int, finished_every: float) -> None:
    """Serve Prometheus metrics at http://HOST:PORT/metrics, read from Redis and
    PostgreSQL at every scrape (stateless: run one anywhere)."""
    import threading

    from balancer.pipeline.metrics import serve

    svc = _migrated()
    try:
        serve(svc, host, port, finished_every=finished_every)
    except OSError as exc:
        raise BalancerError(f"cannot serve metrics on {printable(host)}:{port}: {exc.strerror or exc}") from None
    click.echo(f"serving Prometheus metrics on http://{host}:{port}/metrics", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a deploy's stop is a clean exit (0), not a kill
    stop.wait()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; beyond loopback BALANCER_ROUTER_TOKEN is required.")
@click.option("--port", default=8700, show_default=True, type=click.IntRange(1, 65535))
@click.option("--access-log", is_flag=True, help="Log every request (method, path, status; never the token).")
def router(host: str, port: int, access_log: bool) -> None:
    """Serve the router API (/schedule, /complete, /heartbeat, /advice) on the
    pipeline's quotas, for callers outside Celery. OpenAPI at /docs."""
    try:
        from balancer.router.app import asgi, create_app, is_loopback
        from balancer.router.server import serve
    except ImportError as exc:
        raise BalancerError(f"the router needs its extra: pip install 'balancer[router]' ({exc.name} is missing)") from None
    svc = _migrated()
    token = svc.settings.router_token
    if token is None and not is_loopback(host):
        raise ConfigError(f"BALANCER_ROUTER_TOKEN must be set to serve the router beyond loopback (--host {printable(host)})")
    core = svc.core.with_lease(round(svc.settings.router_lease_seconds * 1000))
    app = create_app(core, lease_ms=core.lease_ms, token=token)
    click.echo(f"router on http://{host}:{port} (token {'required' if token else 'not required'}; "
               f"lease {svc.settings.router_lease_seconds:g} s)", err=True)
    serve(asgi(app), host, port, log_level="info" if access_log else "warning", access_log=access_log)


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


def _projected_dict(projected: Any) -> dict[str, Any]:
    """The backlog left's projected cost for ``status --json``: as ``spend``, without ``by_source``."""
    out = projected.as_dict()
    out.pop("by_source", None)
    return out


def band_fields(drain: Any) -> dict[str, float | None]:
    """The ETA's band for ``status --json``: ``eta_low_s`` and ``eta_high_s`` (None when there is no ETA)."""
    low = None if drain is None or drain.low is None else round(drain.low, 1)
    high = None if drain is None or drain.high is None else round(drain.high, 1)
    return {"eta_low_s": low, "eta_high_s": high}


def band_text(drain: Any) -> str:
    """The ETA's band for a person, after the ETA: `` (3 min 10 s to 4 min 40 s)``; empty when done or unknown.

    >>> from balancer.domain.eta import Forecast
    >>> band_text(Forecast(245.0, 190.0, 280.0)), band_text(Forecast(0.0, 0.0, 0.0)), band_text(None)
    (' (3 min 10 s to 4 min 40 s)', '', '')
    """
    if drain is None or drain.eta is None or drain.eta <= 0 or drain.low is None or drain.high is None:
        return ""
    return f" ({eta_text(max(drain.low, 0.5))} to {eta_text(drain.high)})"


def _model_table(rows: list, rates: dict[str, tuple[float, float]] | None = None):  # noqa: ANN202
    """The per-model table of ``status`` and ``top`` (``rates``: tokens and requests per minute, for top)."""
    from rich.table import Table

    table = Table(title="models")
    columns = ["model", "in flight", "tokens now / burst", "requests now", "429s", "answered", "p50 / p99 s", "binds"]
    if rates is not None:
        columns[3:3] = ["tokens/min / TPM", "requests/min / RPM"]
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        cells = [
            r.name, f"{r.in_flight}/{r.cap}", f"{r.tokens_available:,.0f} / {r.burst:,}",
            "-" if r.requests_available is None else f"{r.requests_available:,.1f}",
            str(r.rate_limited), str(r.solved), f"{r.p50_s:g} / {r.p99_s:g}" + ("" if r.latency_measured else " (prior)"),
            r.binding,
        ]
        if rates is not None:
            tokens, requests = rates.get(r.name, (0.0, 0.0))
            cells[3:3] = [f"{tokens:,.0f} / {r.tpm:,}", f"{requests:,.0f} / {r.rpm:,}" if r.rpm else f"{requests:,.0f} / -"]
        table.add_row(*cells)
    return table


@click.command()
@click.option("--json", "as_json", is_flag=True)
def status(as_json: bool) -> None:
    """Task counts by status, and per model: calls in flight against the cap,
    buckets, 429s, latency, and the limit that holds it back now."""
    from balancer.cli.source import source_line
    from balancer.domain.cost import projection_text, spend_text
    from balancer.pipeline.beat_seen import beat_last_seen_s
    from balancer.pipeline.summary import read
    from balancer.storage.intake import reused_count
    from balancer.storage.leases import overdue_count
    from balancer.storage.sources import source_status
    from balancer.storage.spend import projected_cost, spend_so_far

    svc = _migrated()
    counts, rows, _, drain = read(svc)
    eta = None if drain is None else drain.eta
    overdue = overdue_count(svc.engine)
    beat = beat_last_seen_s(svc.redis, svc.settings.namespace)
    quotas = svc.quotas.all()
    spent, projected = spend_so_far(svc.engine, quotas), projected_cost(svc.engine, quotas)
    sources = source_status(svc.engine)
    with svc.engine.connect() as conn:
        reused = reused_count(conn)
    if as_json:
        click.echo(json.dumps({**counts, "reused": reused, "overdue": overdue, "eta_s": None if eta is None else round(eta, 1),
                               **band_fields(drain),
                               "beat_last_tick_s": None if beat is None else round(beat, 1),
                               "models": [r.as_dict() for r in rows], "spend": spent.as_dict(),
                               "projected": _projected_dict(projected), "sources": [s.as_dict() for s in sources]}))
        return
    click.echo("  ".join(f"{k}: {v}" for k, v in counts.items()) + (f"  reused: {reused}" if reused else "")
               + f"  eta: {eta_text(eta)}{band_text(drain)}")
    if spent.by_model or spent.unpriced_tokens:
        click.echo(spend_text(spent))
    if projected.by_model or projected.unpriced_tokens:
        click.echo(projection_text(projected))
    for s in sources:
        click.echo(f"source {s.name}: {source_line(s)}")
    if beat is None:
        click.echo("beat: not seen lately; the dispatcher runs the periodic ticks itself (start `balancer beat`)")
    if overdue:
        click.echo(f"overdue: {overdue} call(s) whose lease ran out with no heartbeat (a worker is gone); "
                   "the sweep tick returns them to pending")
    if rows:
        from rich.console import Console

        Console(width=max(Console().width, 120)).print(_model_table(rows))


@click.command()
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.1, 60), help="Seconds between refreshes.")
@click.option("--count", type=click.IntRange(1), help="Stop after this many refreshes (default: until Ctrl-C).")
def top(interval: float, count: int | None) -> None:
    """A live view: per model, calls in flight against the cap, tokens and
    requests per minute against TPM and RPM (over the last minute this view
    has seen), 429s, latency and the binding limit; the backlog below."""
    import time
    from collections import deque

    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    from balancer.domain.cost import projection_text, spend_text
    from balancer.pipeline.summary import read
    from balancer.storage.spend import projected_cost, spend_so_far

    svc = _migrated()
    seen: deque[tuple[float, dict[str, dict[str, int]]]] = deque()

    def frame() -> Group:
        counts, rows, counters, drain = read(svc)
        eta = None if drain is None else drain.eta
        now = time.monotonic()
        seen.append((now, counters))
        while len(seen) > 1 and now - seen[0][0] > 60:
            seen.popleft()
        then, old = seen[0]
        minutes = max((now - then) / 60, 1e-9)

        def per_minute(model: str, *fields: str) -> float:
            if now == then:
                return 0.0
            return sum(counters.get(model, {}).get(f, 0) - old.get(model, {}).get(f, 0) for f in fields) / minutes

        rates = {r.name: (per_minute(r.name, "tokens_estimated"), per_minute(r.name, "solved", "transient", "failed"))
                 for r in rows}
        backlog = Text("  ".join(f"{k}: {v}" for k, v in counts.items()) + f"  eta: {eta_text(eta)}{band_text(drain)}")
        quotas = svc.quotas.all()
        money = [Text(line) for line in (spend_text(spend_so_far(svc.engine, quotas)),
                                         projection_text(projected_cost(svc.engine, quotas)))]
        return Group(_model_table(rows, rates), backlog, *money)

    console = Console(width=max(Console().width, 140))
    with Live(frame(), console=console, refresh_per_second=4, auto_refresh=False) as live:
        shown = 1
        while count is None or shown < count:
            time.sleep(interval)
            live.update(frame(), refresh=True)
            shown += 1


@click.command()
@click.option("--tasks", "count", default=500, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--models", default=10, show_default=True, type=click.IntRange(1, 100))
@click.option("--time-scale", default=0.1, show_default=True, type=click.FloatRange(min=0.001),
              help="Latencies and per-minute windows x this.")
@click.option("--seed", default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary as the last line.")
def demo(count: int, models: int, time_scale: float, seed: int, as_json: bool) -> None:
    """The main job: solve a backlog through the simulator, live, within every quota."""
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
def bench(scenario: str, out: Path | None, only: str | None, quota_accounting: str | None, worker_layout: str | None,
          compare_greedy: bool) -> None:
    """Benchmark SCENARIO (a bundled name such as `short`, or a TOML file):
    the pipeline against today's Airflow pattern and the capacity bound."""
    import time

    from balancer.bench.run import main as run_bench
    from balancer.bench.scenarios import locate

    name, _ = locate(scenario)  # a bad name fails here, in one line, before anything starts
    if out is None:
        out = Path("bench-out") / f"{name.removesuffix('.toml')}-{time.strftime('%Y%m%d-%H%M%S')}"
    click.echo(f"writing the report to {out.resolve()}", err=True)
    run_bench(scenario, out, only, quota_accounting, worker_layout, compare_greedy)


COMMANDS = [submit, worker, dispatcher, beat, sim, status, top, metrics, router, demo, bench]

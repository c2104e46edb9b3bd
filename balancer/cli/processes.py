"""The long-running processes' commands: worker, dispatcher, beat, sim, metrics, router."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from balancer.cli import resolved_settings, services, settings
from balancer.cli.startwait import migrated as _migrated
from balancer.cli.startwait import start_when_ready
from balancer.errors import BalancerError, ConfigError, QuotaError, QuotaRemoved, printable

#: The log level option of every command that runs a process of the pipeline.
loglevel_option = click.option("--loglevel", default="INFO", show_default=True,
                               type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], case_sensitive=False),
                               help="What the process logs, from the most (DEBUG) to the least (CRITICAL).")

if TYPE_CHECKING:
    from balancer.admission.quota import Quota
    from balancer.services import Services


def _celery_worker(argv: list[str], pool: str, *, all_models: bool = False) -> None:
    import balancer.pipeline.tasks  # noqa: F401 - registers tasks and the quota watcher
    from balancer.pipeline.app import app

    # A class path is accepted by the worker_pool setting, not by `-P` (a fixed choice list).
    app.conf.worker_pool = pool
    app.conf.balancer_all_models = all_models  # the quota watcher adds queues of models created later
    celery_command(app, argv)


def celery_command(app: Any, argv: list[str]) -> None:
    """Run a ``celery`` subcommand (worker, flower) on ``app``, exiting with its code.

    Not app.worker_main (nor app.start), which drop the exit code that click's
    non-standalone main returns: after an "Unrecoverable error" the process
    would exit 0, and a restart-on-failure supervisor (compose, systemd)
    would leave it down. This is app.start, keeping the code."""
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


#: Seconds a starting process gives a backend port that refuses connections before it warns:
#: `balancer sim &` then `balancer run` raced the simulator's bind (a new user's warning).
BACKEND_START_GRACE = 3.0


def warn_if_backend_refuses() -> None:
    """The first line a process prints when the Models Backend's address refuses connections
    (it starts all the same: the backend may come up later)."""
    from balancer.backends.probe import refusal

    problem = refusal(settings().backend_url, grace=BACKEND_START_GRACE)
    if problem:
        click.echo(f"warning: {problem}: its calls will fail until it answers (BALANCER_BACKEND_URL)", err=True)


def warn_if_a_beat_ticks(svc: Services) -> None:
    """The line a command that starts a beat prints when a beat's dispatch tick ran lately: a deployment
    runs exactly one beat, and a second doubles every tick (production.md). It starts all the same (a beat
    restarted at once reads its own last tick)."""
    from balancer.dispatch.beat_seen import beat_last_seen_s

    seen = beat_last_seen_s(svc.redis, svc.settings.namespace)
    if seen is not None:
        click.echo(f"warning: a beat's dispatch tick ran {seen:.1f} s ago: if another beat runs, stop one "
                   "(run exactly one beat: a second doubles every tick)", err=True)


def _worker_quotas(svc: Services, models: tuple[str, ...], all_models: bool) -> dict[str, Quota]:
    """The quotas a worker consumes for; :class:`QuotaRemoved` while every one
    missing had one once (a worker restarted while its quota is re-created).

    The removals are read before the quotas: a create writes its quota and its audit row
    in one transaction, so a quota created between the two reads is found by the second.
    In the other order it was read as missing, then as never removed: a name that never
    had a quota, and the worker exited 2 just as its quota came back."""
    removed = svc.quotas.removed(None if all_models else sorted(set(models)))
    known = {q.name: q for q in svc.quotas.all()}
    if all_models:
        if not known:
            if removed:
                raise QuotaRemoved(f"no model has a quota: the last was removed at {_when(removed)}")
            raise QuotaError("no model has a quota: add one with `balancer quota set NAME --create ...`")
        return known
    unknown = sorted(set(models) - set(known))
    if not unknown:
        return {m: known[m] for m in models}
    never = [m for m in unknown if m not in removed]
    if never:
        raise QuotaError(f"unknown model(s): {', '.join(printable(m) for m in never)}")
    raise QuotaRemoved(f"no quota for {', '.join(printable(m) for m in unknown)}: "
                       f"removed at {_when({m: removed[m] for m in unknown})}")


def _when(removed: dict[str, dict[str, Any]]) -> str:
    return f"{max(r['changed_at'] for r in removed.values()):%Y-%m-%d %H:%M:%S %Z}"


@click.command()
@click.option("--model", "models", multiple=True, help="Model whose queue model.<name> to consume (repeatable).")
@click.option("--all-models", is_flag=True, help="Consume every configured model's queue in one process.")
@loglevel_option
def worker(models: tuple[str, ...], all_models: bool, loglevel: str) -> None:
    """A worker pool for one or more models, sized to their max_concurrent_requests."""
    if not models and not all_models:
        raise BalancerError("give the models to consume: --model NAME (repeatable), or --all-models")
    if models and all_models:
        raise BalancerError("give --model NAME (repeatable) or --all-models, not both")
    warn_if_backend_refuses()
    svc = _migrated(wait=True)
    known = start_when_ready(lambda: _worker_quotas(svc, models, all_models), resolved_settings().start_wait,
                             retry_on=(QuotaRemoved,), awaited="a removed quota to come back")
    queues, concurrency, name = worker_pool(known, models, all_models)
    # The pid keeps node names unique when several processes share a host
    # (RabbitMQ's exclusive pidbox queue refuses a second node of the same name).
    _celery_worker([
        "worker", "-Q", queues, "-c", str(concurrency),
        "-n", f"{name[:50]}-{os.getpid()}@%h", "--without-gossip", "--without-mingle", "-l", loglevel,
    ], pool="balancer.calls.pool:ResizableThreadPool", all_models=all_models)


def worker_pool(known: dict[str, Quota], models: tuple[str, ...], all_models: bool) -> tuple[str, int, str]:
    """The queues a worker consumes, its pool size and its node name: every
    model's queue once (a ``--model`` given twice does not double the pool), the
    pool the sum of their concurrency caps.

    >>> from balancer.admission.quota import Quota
    >>> q = {m: Quota(m, c, 60_000) for m, c in (("a", 4), ("b", 2))}
    >>> worker_pool(q, ("b", "a", "b"), False)
    ('model.b,model.a', 6, 'b+a')
    >>> worker_pool(q, (), True)
    ('model.a,model.b', 6, 'models')
    """
    from balancer.admission import keys

    chosen = sorted(known) if all_models else list(dict.fromkeys(models))
    concurrency = sum(known[m].max_concurrent_requests for m in chosen)
    return ",".join(keys.model_queue(m) for m in chosen), concurrency, "models" if all_models else "+".join(chosen)


@click.command()
@loglevel_option
def dispatcher(loglevel: str) -> None:
    """The dispatcher: consumes the control queue (dispatch, ingest, sweep)."""
    from balancer.admission import keys

    _migrated(wait=True)
    _celery_worker([
        "worker", "-Q", keys.CONTROL_QUEUE, "-c", "2", "-n", f"dispatcher-{os.getpid()}@%h",
        "--without-gossip", "--without-mingle", "-l", loglevel,
    ], pool="threads")


@click.command()
@loglevel_option
def beat(loglevel: str) -> None:
    """Celery beat: periodic dispatch, sweep and ingest ticks."""
    home = Path(resolved_settings().home)  # exports the URLs before the app reads celeryconfig
    start_when_ready(services, resolved_settings().start_wait)  # its ticks need both: wait, not crash-loop
    warn_if_a_beat_ticks(services())
    from balancer.pipeline.app import app

    home.mkdir(parents=True, exist_ok=True)
    app.Beat(loglevel=loglevel, schedule=str(home / "celerybeat-schedule")).run()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 to expose it).")
@click.option("--port", default=8900, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--models", "count", default=10, show_default=True, type=click.IntRange(1, 100), help="How many default models.")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.0001),
              help="Multiplies latencies and per-minute windows.")
@click.option("--error-rate", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="Share of calls answered with a 500 (a flaky backend).")
@click.option("--accounting", type=click.Choice(["reserve", "settle"]), default="reserve", show_default=True,
              help="How the default models count tokens: reserve (kept, strict) or settle (unused part refunded).")
@click.option("--seed", default=0, show_default=True, help="Seed of the latencies and answer lengths it draws.")
@click.option("--grace", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds of refill tolerated above the buckets (0: strict, as providers are).")
@click.option("--untagged-draws", is_flag=True,
              help="A prompt's leading '[tag] ' does not change its latency and length (the same batch under two tags).")
@click.option("--log", "log_path", type=click.Path(dir_okay=False, path_type=Path), help="Append every call to this JSONL file.")
@click.option("--scenario", help="Take models and time scale from a scenario (bundled name or TOML file).")
@click.option("--print-quotas", is_flag=True,
              help="Print the quota file of the models it serves (for `balancer quota import`), and exit.")
def sim(host: str, port: int, count: int, time_scale: float, error_rate: float, accounting: str, seed: int, grace: float,
        untagged_draws: bool, log_path: Path | None, scenario: str | None, print_quotas: bool) -> None:
    """Run the simulated Models Backend (its models: model-0, model-1, ...; --print-quotas shows their limits)."""
    import dataclasses

    import uvicorn

    from balancer.devtools.sim.config import default_models
    from balancer.devtools.sim.provider import Simulator
    from balancer.devtools.sim.server import create_app
    from balancer.router.server import BACKLOG, listening_sockets

    if scenario is not None:
        from balancer.bench.scenarios import locate
        from balancer.devtools.scenario import parse_scenario

        file_name, text = locate(scenario)
        spec = parse_scenario(text, file_name)
        models, time_scale, count = list(spec.models), spec.time_scale, len(spec.models)
    else:
        models = [dataclasses.replace(m, error_rate=error_rate, accounting=accounting) for m in default_models(count)]
    if print_quotas:
        from balancer.quotas.file import format_quota_file

        click.echo(f"# The simulator's {len(models)} models at time scale {time_scale:g}: "
                   "`balancer quota import FILE` (their names and limits)")
        click.echo(format_quota_file([m.quota(time_scale=time_scale) for m in models]), nl=False)
        return
    simulator = Simulator(models, time_scale=time_scale, seed=seed, grace=grace, log_path=log_path,
                          untagged_draws=untagged_draws)
    sockets = listening_sockets(host, port)
    click.echo(f"simulated Models Backend on http://{host}:{port} ({count} models, time scale {time_scale})", err=True)
    config = uvicorn.Config(create_app(simulator), host=host, port=port, log_level="warning", backlog=BACKLOG)
    uvicorn.Server(config).run(sockets=sockets)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 to expose it).")
@click.option("--port", default=9808, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--finished-every", default=60.0, show_default=True, type=click.FloatRange(0, 86_400),
              help="Seconds between recounts of solved, failed and cancelled tasks (they read the whole history).")
def metrics(host: str, port: int, finished_every: float) -> None:
    """Serve Prometheus metrics at http://HOST:PORT/metrics (and no other path), read from
    Redis and PostgreSQL at every scrape (stateless: run one anywhere). With
    BALANCER_METRICS_TOKEN set, a scrape must send it as a bearer token."""
    import threading

    from balancer.views.metrics import serve

    svc = _migrated()
    token = svc.settings.metrics_token
    try:
        serve(svc, host, port, finished_every=finished_every, token=token)
    except OSError as exc:
        raise BalancerError(f"cannot serve metrics on {printable(host)}:{port}: {exc.strerror or exc}") from None
    click.echo(f"serving Prometheus metrics on http://{host}:{port}/metrics "
               f"(token {'required' if token else 'not required: set BALANCER_METRICS_TOKEN to require one'})", err=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # a deploy's stop is a clean exit (0), not a kill
    stop.wait()


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; beyond loopback BALANCER_ROUTER_TOKEN is required.")
@click.option("--port", default=8700, show_default=True, type=click.IntRange(1, 65535), help="Port to listen on.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="A name the router is reached by (a DNS name, a reverse proxy's), beside the bound address; "
                   "requests naming any other Host are refused (DNS rebinding). Repeatable.")
@click.option("--access-log", is_flag=True, help="Log every request (method, path, status; never the token).")
def router(host: str, port: int, allow_hosts: tuple[str, ...], access_log: bool) -> None:
    """Serve the router API (/schedule, /complete, /heartbeat, /advice) on the
    pipeline's quotas, for callers outside Celery. OpenAPI at /docs."""
    try:
        from balancer.httpguard import is_loopback
        from balancer.router.app import asgi, create_app
        from balancer.router.server import listening_sockets, serve
    except ImportError as exc:
        raise BalancerError(f"the router needs its extra: pip install 'balancer[router]' ({exc.name} is missing)") from None
    svc = _migrated()
    token = svc.settings.router_token
    if token is None and not is_loopback(host):
        raise ConfigError(f"BALANCER_ROUTER_TOKEN must be set to serve the router beyond loopback (--host {printable(host)})")
    core = svc.core.with_lease(round(svc.settings.router_lease_seconds * 1000))
    app = create_app(core, lease_ms=core.lease_ms, token=token, bound=host, allow_hosts=allow_hosts)
    sockets = listening_sockets(host, port)
    click.echo(f"router on http://{host}:{port} (token {'required' if token else 'not required'}; "
               f"lease {svc.settings.router_lease_seconds:g} s)", err=True)
    serve(asgi(app), host, port, sockets=sockets, log_level="info" if access_log else "warning", access_log=access_log)

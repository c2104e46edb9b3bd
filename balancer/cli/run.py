"""``balancer run``: the whole pipeline on this host, supervised.

The dispatcher, the workers (one process for every model, or ``--per-model``)
and beat, each a ``balancer`` process of its own (the commands a multi-host
deployment runs one by one), against the services the ``BALANCER_*_URL``
variables name. Each logs to a file of its own under ``--log-dir``; one that
exits is started again (:mod:`balancer.supervisor`); Ctrl-C or SIGTERM stops
them all together, the workers once their calls in flight have ended (a second Ctrl-C: at once).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import click

from balancer.cli import resolved_settings
from balancer.cli.processes import loglevel_option, warn_if_a_beat_ticks, warn_if_backend_refuses
from balancer.cli.startwait import migrated
from balancer.errors import ConfigError, QuotaError


@click.command()
@click.option("--per-model", is_flag=True,
              help="One worker process per model (each its own GIL); models created later need a restart. "
                   "Default: one worker process for every model, which also takes models created later.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where each process logs, one file each [default: BALANCER_HOME/logs].")
@loglevel_option
def run(per_model: bool, log_dir: Path | None, loglevel: str) -> None:
    """Run the dispatcher, the workers and beat here, restart any that exits, stop them together on Ctrl-C."""
    from balancer.supervisor import Supervisor, pipeline_plan

    settings = resolved_settings()  # exports the embedded stack's URLs (when none is set) to the children
    logs = (log_dir or Path(settings.home) / "logs").resolve()
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission: one line, before any process starts
        raise ConfigError(f"cannot create the log directory {logs}: {exc.strerror or exc}") from None
    warn_if_backend_refuses()
    svc = migrated()
    warn_if_a_beat_ticks(svc)  # run starts a beat of its own
    names = sorted(q.name for q in svc.quotas.all())
    if not names:
        raise QuotaError("no model has a quota: import them first with `balancer quota import FILE`")
    stop, cut = threading.Event(), threading.Event()  # the first Ctrl-C (or SIGTERM) stops; a second cuts short
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: (cut if stop.is_set() else stop).set())
    plan = pipeline_plan(names if per_model else None, loglevel)
    with Supervisor(logs, env=dict(os.environ), restart_dead=True) as supervisor:
        for child in supervisor.start_plan(plan):
            click.echo(f"{child.name}: pid {child.process.pid}, log {child.log}", err=True)
        click.echo(f"running {len(plan)} processes for {len(names)} model(s); Ctrl-C stops them all", err=True)
        while not stop.wait(0.5):
            for event in supervisor.check_alive():
                click.echo(event, err=True)
        grace = settings.hard_time_limit  # the longest a call in flight may still take
        click.echo(f"stopping: the workers finish their calls in flight first (up to {grace:g} s); "
                   "Ctrl-C again stops them now", err=True)
        if cut_short := [c.name for c in supervisor.stop_gracefully(grace, cut) if c.argv[0] == "worker"]:
            click.echo(f"stopped before their calls in flight ended: {', '.join(cut_short)} (those calls' tasks "
                       "run again once their leases lapse, BALANCER_LEASE_SECONDS)", err=True)
    click.echo("stopped", err=True)

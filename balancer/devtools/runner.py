"""Run the whole pipeline on one machine, isolated: shared by the demo and the benchmark.

:class:`IsolatedServices` uses the configured Redis/PostgreSQL (or starts an
embedded stack) inside a schema and a Redis namespace of its own, and drops
both on exit. :func:`run_pipeline` starts the simulator and the processes ``balancer run``
starts (:func:`balancer.supervisor.pipeline_plan`): the dispatcher, one worker
process holding every model's pool (or one per model), and beat; submits a backlog;
watches it drain; and returns the simulator's call log and the tasks' timings.
Every process it starts is stopped on exit, including on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from celery import Celery
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from balancer.admission import keys
from balancer.admission.quota import Quota
from balancer.backlog.intake import parse_tasks
from balancer.devtools.embedded import TemporaryStack, free_port
from balancer.services import Services, delete_namespace_keys
from balancer.settings import Settings
from balancer.storage.schema import tasks as tasks_table
from balancer.supervisor import Supervisor, pipeline_plan, wait_for_http
from balancer.urls import normalize_database_url
from balancer.views.summary import after_the_end_text, calls_after_the_end


@contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the processes started inside, then restore them."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class IsolatedServices:
    """Redis + PostgreSQL for one run, in a namespace and schema of its own.

    Everything it starts or creates is undone on exit, and also when entering
    fails halfway (an embedded server that did start is stopped). Its temp
    directory (logs, an embedded stack) is deleted on exit unless
    ``keep_workdir`` (the benchmarks keep their logs)."""

    def __init__(self, console: Console, label: str = "run", *, keep_workdir: bool = True) -> None:
        self.console = console
        self.label = label
        self.keep_workdir = keep_workdir
        self._stack = ExitStack()

    def __enter__(self) -> IsolatedServices:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"balancer-{self.label}-"))
        if not self.keep_workdir:
            self._stack.callback(shutil.rmtree, self.workdir, True)
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self) -> None:
        base = Settings.from_env()
        if base.redis_url and base.database_url:
            self.redis_url, self.database_url = base.redis_url, base.database_url
            self.console.print("using the services in BALANCER_REDIS_URL / BALANCER_DATABASE_URL")
        else:
            self.console.print("starting embedded Redis and PostgreSQL ...")
            stack = self._stack.enter_context(TemporaryStack(self.workdir / "stack"))
            self.redis_url, self.database_url = stack.redis_url, stack.database_url
        run_id = uuid.uuid4().hex[:8]
        self.namespace, self.schema = f"{self.label}-{run_id}", f"balancer_{self.label}_{run_id}"
        self._admin = sa.create_engine(normalize_database_url(self.database_url))
        with self._admin.begin() as conn:
            conn.execute(sa.schema.CreateSchema(self.schema))
        self._stack.callback(self._drop_own_state)
        url = sa.engine.make_url(normalize_database_url(self.database_url))
        url = url.update_query_dict({"options": f"-csearch_path={self.schema}"})
        self.env = {
            "BALANCER_REDIS_URL": self.redis_url,
            "BALANCER_DATABASE_URL": url.render_as_string(hide_password=False),
            "BALANCER_NAMESPACE": self.namespace,
            "BALANCER_DISPATCH_TICK": "0.5",
            "BALANCER_SWEEP_TICK": "5",
        }
        self._stack.enter_context(environment(self.env))
        from balancer.storage.migrate import upgrade

        self.services = Services.connect(Settings.from_env())
        upgrade(self.services.engine)

    def _drop_own_state(self) -> None:
        import redis

        from balancer.storage.db import dispose_engines

        dispose_engines()
        with self._admin.begin() as conn:
            conn.execute(sa.schema.DropSchema(self.schema, cascade=True, if_exists=True))
        self._admin.dispose()
        try:
            delete_namespace_keys(redis.Redis.from_url(self.redis_url, socket_connect_timeout=5), self.namespace)
        except redis.ConnectionError as exc:  # a run that killed its own Redis: its result still stands
            self.console.print(f"[yellow]could not delete namespace {self.namespace}'s keys: {exc}[/yellow]")

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def supervisor(self) -> Supervisor:
        """Children that run this process's code: started from the tree its ``balancer``
        came from (:func:`code_tree`), whatever directory the run was started in."""
        return self._stack.enter_context(Supervisor(self.workdir / "logs", env={**os.environ}, cwd=code_tree()))

    def start_sim(self, supervisor: Supervisor, sim_args: Sequence[str]) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        child = supervisor.start(f"sim-{port}", ["sim", "--port", str(port), *sim_args])
        wait_for_http(f"{url}/models", child=child)
        os.environ["BALANCER_BACKEND_URL"] = url
        supervisor.env["BALANCER_BACKEND_URL"] = url
        return url

    def insert(self, jsonl: str) -> int:
        rows, errors = parse_tasks(jsonl, models={q.name: q.burst for q in self.services.quotas.all()})
        if errors:
            raise ValueError(f"workload has bad lines: {errors[:3]}")
        from balancer.backlog.insert import insert_tasks

        with self.services.engine.begin() as conn:
            insert_tasks(conn, rows)
        return len(rows)

    def task_rows(self) -> list[Any]:
        with self.services.engine.connect() as conn:
            return list(conn.execute(sa.select(tasks_table).order_by(tasks_table.c.id)).all())


def code_tree() -> Path:
    """The directory this process's ``balancer`` package is in (a checkout, or site-packages).
    A child started with ``python -m balancer`` from another checkout would run that one's code,
    since ``python -m`` puts the working directory first on sys.path."""
    import balancer

    return Path(balancer.__file__).resolve().parent.parent


def control_app(name: str = "balancer-control") -> Celery:
    """A Celery app configured from the *current* environment (this run's broker
    and namespace); the module-level app keeps the environment it was first
    imported in."""
    import celeryconfig

    app = Celery(name)
    app.conf.update(celeryconfig.from_settings(Settings.from_env()))
    return app


def wait_until_consuming(supervisor: Supervisor, nodes: int, timeout: float = 120.0) -> None:
    """Block until ``nodes`` Celery workers (this run's dispatcher and worker
    processes) answer a ping, so a timed run does not count their start-up."""
    app = control_app("balancer-runner-control")
    deadline = time.monotonic() + timeout
    try:
        while len(app.control.ping(timeout=0.5) or []) < nodes:
            supervisor.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the pipeline's {nodes} Celery processes did not answer within {timeout:.0f}s")
    finally:
        app.close()


def ask_for_dispatch(services: Services) -> None:
    """Request a dispatch run now, through the same flag the pipeline uses."""
    from balancer.dispatch.trigger import request_dispatch

    app = control_app("balancer-runner-submit")
    try:
        request_dispatch(services.redis, services.settings.namespace, lambda _: app.send_task(keys.DISPATCH_TASK))
    finally:
        app.close()


def fetch_log(backend_url: str, since: int, *, running: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The simulator's log entries from ``since``, and the cursor for the next read. With ``running``
    (the run's last read), also, read with them (no call ends between the two), the calls it is
    still running (a hedge's loser can outlast the run) as entries that end now: status 0 and
    ``unfinished``. Without them the run's calls in flight, and what the provider counted, would
    miss them."""
    params: dict[str, Any] = {"since": since, **({"running": "true"} if running else {})}
    reply = httpx.get(f"{backend_url}/log", params=params, timeout=30).json()
    unfinished = [{**call, "end": reply["at"], "status": 0, "completion_tokens": 0, "unfinished": True}
                  for call in reply.get("running", [])]
    return reply["entries"] + unfinished, reply["next"]


#: Shares of the backlog done at which the bench records the drain ETA.
ETA_MARKS = (0.10, 0.25, 0.50, 0.75)
#: Seconds between the ETA polls the bench records (the marks are polled as well).
ETA_POLL_S = 3.0


def eta_sample(svc: Any, at: float, done: int) -> dict[str, Any]:
    """One poll of the drain ETA as `balancer status --json` reads it: the forecast,
    its band and the state it came from (to replay other estimators on it)."""
    from dataclasses import asdict

    from balancer.backlog.spend import projected_cost, spend_so_far
    from balancer.views.eta import forecast
    from balancer.views.summary import PACE_WINDOW_S, drain_inputs, pace_window_s

    def recorded(state: Any) -> dict[str, Any] | None:
        return None if state is None else {**asdict(state), "models": {k: asdict(v) for k, v in state.models.items()},
                                           "on_prior": list(state.on_prior)}

    view = svc.core.live()
    pace_s = pace_window_s(view, time.time() * 1000)
    state = drain_inputs(svc, view, pace_s=pace_s)
    result = forecast(state) if state is not None else None
    quotas = svc.quotas.all()
    sample = {"at_s": round(at, 3), "done": done, "spent": spend_so_far(svc.engine, quotas).total,
              "projected": projected_cost(svc.engine, quotas).total, "eta_s": None if result is None else result.eta,
              "low_s": None if result is None else result.low, "high_s": None if result is None else result.high,
              "state": recorded(state)}
    if state is not None and pace_s < PACE_WINDOW_S:  # a learned change shortened the pace's window: the whole minute too
        sample["state_full_pace"] = recorded(drain_inputs(svc, view, pace_s=PACE_WINDOW_S))
    return sample


@dataclass
class RunResult:
    entries: list[dict[str, Any]]
    started: float
    finished: float
    counts: dict[str, int]
    rows: list[Any]
    #: Per model, the latency the pipeline learned (balancer.estimates.latency), read at the end of the run.
    learned_latency: dict[str, Any] = field(default_factory=dict)
    #: Drain ETAs made during the run: (share of tasks done, seconds since the start, the ETA in s or None).
    etas: list[tuple[float, float, float | None]] = field(default_factory=list)
    #: The ETA polled through the run, every ETA_POLL_S and once after the end: see :func:`eta_sample`.
    eta_samples: list[dict[str, Any]] = field(default_factory=list)
    #: The ledger at the end, ``(source, model, prompt tokens, completion tokens)``: every call, hedges' included.
    ledger: list[tuple[str, str, int, int]] = field(default_factory=list)
    #: Whether every call had ended and reached the ledger when it was read (see ``settle_s``).
    settled: bool = False

    @property
    def makespan(self) -> float:
        return self.finished - self.started


TableMaker = Callable[[dict, dict[str, int]], Table]


def recent_tokens(entries: list[dict[str, Any]], now: float, window: float = 60.0) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in reversed(entries):
        if e["start"] < now - window:
            break
        if e["status"] != 429:
            out[e["model"]] = out.get(e["model"], 0) + e.get("prompt_tokens", 0) + e.get("completion_tokens", 0)
    return out


def run_pipeline(
    iso: IsolatedServices,
    *,
    quotas: Sequence[Quota],
    sim_args: Sequence[str],
    backlog_jsonl: str,
    console: Console,
    table: TableMaker | None = None,
    timeout: float = 1800.0,
    worker_layout: str = "one",
    settle_s: float = 0.0,
) -> RunResult:
    """Start everything, submit the backlog, wait until every task is solved or failed.

    ``worker_layout`` is "one" (a single worker process holds every model's
    pool) or "per-model" (one process per model). The clock starts once the
    Celery processes answer a ping and stops at the last task's final write.
    With ``settle_s``, the calls still running then (a hedge's loser runs to
    its end) get up to that long to end and reach the ledger, which is read
    last (:attr:`RunResult.ledger`).
    """
    from balancer.backlog.ledger import calls_recorded
    from balancer.backlog.reads import status_counts
    from balancer.backlog.spend import token_usage
    from balancer.views.summary import estimate_drain

    svc = iso.services
    svc.quotas.replace_all(list(quotas), by="runner")
    supervisor = iso.supervisor()
    kept = "" if iso.keep_workdir else ", deleted when the run ends"  # the demo's: nothing outlives it
    console.print(f"starting the simulator, dispatcher, workers and beat (logs in {iso.workdir / 'logs'}{kept}) ...")
    backend_url = iso.start_sim(supervisor, sim_args)
    # The processes `balancer run` starts; "per-model" as docker-compose.yml deploys: one process (one GIL) per model.
    plan = pipeline_plan([q.name for q in quotas] if worker_layout == "per-model" else None, "WARNING")
    supervisor.start_plan(plan, {"BALANCER_HOME": str(iso.workdir)})
    wait_until_consuming(supervisor, nodes=len(plan) - 1)  # all but beat; the clock measures the run, not start-up
    started = time.time()
    total = iso.insert(backlog_jsonl)
    ask_for_dispatch(svc)  # as `balancer submit` does after its insert, not wait for beat's next tick
    console.print(f"submitted {total} prompts; draining ...")
    entries: list[dict[str, Any]] = []
    cursor = rejected = 0
    # The harness shares the machine with the pipeline it measures: without a live
    # table it reads the simulator's log every 5 s, not every poll.
    log_every, log_read_at = (0.5 if table is not None else 5.0), 0.0
    progress = Progress(TextColumn("solving"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=console)
    bar = progress.add_task("solve", total=total, info="")
    eta_marks, etas, samples, polled_at = list(ETA_MARKS), [], [], 0.0
    with Live(Group(progress), console=console, refresh_per_second=4, transient=False) as live:
        while True:
            supervisor.check_alive()
            if time.monotonic() - log_read_at >= log_every:
                new, cursor = fetch_log(backend_url, cursor)
                entries.extend(new)
                rejected += sum(1 for e in new if e["status"] == 429)
                log_read_at = time.monotonic()
            counts = status_counts(svc.engine)
            done = counts["solved"] + counts["failed"]
            while eta_marks and done >= eta_marks[0] * total:  # the ETA a user would have read at that moment
                etas.append((eta_marks.pop(0), time.time() - started, estimate_drain(svc)))
            if time.monotonic() - polled_at >= ETA_POLL_S and done < total:
                samples.append(eta_sample(svc, time.time() - started, done))
                polled_at = time.monotonic()
            progress.update(bar, completed=done, info=f"failed {counts['failed']}  429s {rejected}")
            parts: list[Any] = [progress]
            if table is not None:
                view = svc.core.live()
                parts.append(table(view, recent_tokens(entries, time.time())))
                if after := calls_after_the_end(counts, view.values()):  # the last frame: a hedge's loser still runs
                    parts.append(Text(after_the_end_text(after)))
            live.update(Group(*parts))
            if done >= total:
                finished = time.time()
                break
            if time.time() - started > timeout:
                raise RuntimeError(f"not finished within {timeout:.0f}s: {counts}")
            time.sleep(0.5)
    samples.append(eta_sample(svc, time.time() - started, total))  # nothing left: it must say 0
    time.sleep(0.2)
    settle_until = time.monotonic() + settle_s
    while True:
        new, cursor = fetch_log(backend_url, cursor)
        entries.extend(new)
        # Every call the backend logged has its ledger row, and none is still running.
        settled = not any(m.in_flight for m in svc.core.live().values()) and calls_recorded(svc.engine) >= len(entries)
        if settled or time.monotonic() >= settle_until:
            break
        time.sleep(0.5)
    entries.extend(fetch_log(backend_url, cursor, running=True)[0])
    rows = iso.task_rows()
    # The last write, not when this loop noticed it (it polls every 0.5 s).
    finished = min(finished, max((r.updated_at.timestamp() for r in rows), default=finished))
    learned = {name: m.latency for name, m in svc.core.live().items()}
    counts = status_counts(svc.engine)
    # Calls that started with no dispatcher in between: a finishing call took them from a ready list.
    counts["ready_taken"] = sum(c.get("ready_taken", 0) for c in svc.core.counters()[0].values())
    result = RunResult(entries, started, finished, counts, rows, learned, etas, samples, token_usage(svc.engine),
                       settled)
    supervisor.stop_all()
    return result

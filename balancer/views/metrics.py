"""``balancer metrics``: a Prometheus exporter that reads the live state at every scrape.

Stateless: every figure comes from Redis (the admission state, and the
counters the Lua scripts and the workers keep under ``{ns}:stats:<model>``
and ``{ns}:stats``) and from PostgreSQL (the backlog) at the moment of the
scrape. So one exporter serves any number of workers on any number of hosts,
the counters add up whichever process made the call, and restarting the
exporter loses nothing. Names follow Prometheus conventions: ``_total`` for
counters, base units (seconds, tokens), one ``model`` label.

A scrape's cost does not grow with the history of finished tasks: it counts
the live statuses from their partial indexes, and recounts the finished
ones (``balancer_tasks{status="solved"|"failed"|"cancelled"}``) at most once
``balancer metrics --finished-every`` seconds (a minute by default), in one
scrape while the others report the last count (``balancer tasks prune`` keeps that
recount short).

>>> sorted(m.name for m in BalancerCollector(None).describe())[:3]
['balancer_admission_decisions', 'balancer_backlog_projected_cost', 'balancer_dispatch_rounds']
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine

from balancer.admission.quota import Quota
from balancer.admission.values import TRANSIT_MS
from balancer.backlog.reads import Backlog, backlog
from balancer.backlog.retention import FINISHED_RECOUNT_S, finished_counts, live_status_counts
from balancer.backlog.spend import charges, observed_usage
from balancer.costs.budget import held
from balancer.costs.cost import Charged, Observed, price_list, project
from balancer.dispatch.budgets import read_standings
from balancer.estimates import latency
from balancer.health.facts import read_health
from balancer.health.reasons import REASONS, kinds
from balancer.httpguard import READ_TIMEOUT_S, HostNames, host_name
from balancer.services import Services
from balancer.sources.metrics import add_source_metrics, source_families
from balancer.sources.reads import writebacks_by_source
from balancer.views.summary import estimate_band

#: Outcomes of a call, as ``balancer_model_calls_total{outcome}`` counts them.
OUTCOMES = ("solved", "rate_limited", "transient", "failed")
#: Latency histogram edges: one per doubling of the sketch's buckets (50 ms, 100 ms ... ~27 min).
EDGE_BUCKETS = tuple(range(0, latency.BUCKETS, latency.PER_DOUBLING))


def backlog_by_model(groups: Iterable[tuple[Sequence[str] | None, int]], models: Iterable[str]) -> dict[str, tuple[int, int]]:
    """Per model: (pending tasks it may run, pending tasks pinned to it), from
    pending counts grouped by their allowed models (None: any model).

    >>> backlog_by_model([(None, 5), (["a"], 2), (["a", "b"], 3)], ["a", "b"])
    {'a': (10, 2), 'b': (8, 0)}
    """
    out = {m: (0, 0) for m in models}
    for allowed, n in groups:
        for m in out:
            if allowed is None or m in allowed:
                can, pinned = out[m]
                out[m] = (can + n, pinned + (n if allowed is not None and list(allowed) == [m] else 0))
    return out


def latency_buckets(counters: Mapping[str, int]) -> list[tuple[str, int]]:
    """Cumulative ``(le, count)`` pairs of one model's latency counters (``lat<i>``), seconds.

    >>> latency_buckets({"lat0": 2, "lat3": 1, "lat5": 4})[:3]
    [('0.05', 2), ('0.1', 3), ('0.2', 7)]
    """
    per_bucket = [counters.get(f"lat{i}", 0) for i in range(latency.BUCKETS)]
    out, running, last = [], 0, 0
    for edge in EDGE_BUCKETS:
        running += sum(per_bucket[last:edge + 1])
        last = edge + 1
        out.append((f"{latency.upper_ms(edge) / 1000:g}", running))
    out.append(("+Inf", running + sum(per_bucket[last:])))
    return out


def refill_gap_buckets(counters: Mapping[str, int]) -> list[tuple[str, int]]:
    """Cumulative ``(le, count)`` pairs, seconds, of one model's refill gaps, from
    the ``gap<le ms>`` counters admit.lua keeps (``gapinf`` above the last edge).

    >>> refill_gap_buckets({"gap5": 3, "gap25": 1, "gapinf": 2, "gap_ms": 9})
    [('0.005', 3), ('0.025', 4), ('+Inf', 6)]
    """
    edges = sorted(int(k[3:]) for k in counters if k.startswith("gap") and k[3:].isdigit())
    out, running = [], 0
    for edge in edges:
        running += counters[f"gap{edge}"]
        out.append((f"{edge / 1000:g}", running))
    out.append(("+Inf", running + counters.get("gapinf", 0)))
    return out


class BalancerCollector(Collector):
    """Reads Redis and PostgreSQL on each ``collect`` (a scrape)."""

    def __init__(self, services: Services | None, *, finished_every: float = FINISHED_RECOUNT_S) -> None:
        self.services = services
        self.finished_every = finished_every
        self._finished: dict[str, int] | None = None
        # Read with the finished counts, at the same pace: spend so far by (source, model), from the
        # ledger, and what each model's answered calls used against their estimates.
        self._usage: list[Charged] = []
        self._observed: dict[str, Observed] = {}
        self._finished_at = 0.0
        self._recount = threading.Lock()

    def finished(self, engine: Engine) -> dict[str, int]:
        """Finished tasks by status, recounted at most once per ``finished_every`` seconds, by one scrape."""
        stale = time.monotonic() - self._finished_at >= self.finished_every
        if (stale or self._finished is None) and self._recount.acquire(blocking=self._finished is None):
            try:
                if self._finished is None or time.monotonic() - self._finished_at >= self.finished_every:
                    self._finished = finished_counts(engine)
                    self._usage, self._observed = charges(engine), observed_usage(engine)
                    self._finished_at = time.monotonic()
            finally:
                self._recount.release()
        return dict(self._finished or {})

    def describe(self) -> Iterator[Metric]:
        return iter(self._families().values())

    def collect(self) -> Iterator[Metric]:
        svc = self.services
        if svc is None:  # a collector built only to describe its metrics
            return iter(())
        view = svc.core.live()
        per_model, system = svc.core.counters()
        left = backlog(svc.engine)
        by_model = backlog_by_model(((allowed, n) for allowed, n, _ in left.pending_groups()), view)
        families = self._families()
        for name, live in view.items():
            q, stats = live.quota, per_model.get(name, {})
            can_run, pinned = by_model[name]
            values: dict[str, Any] = {
                "balancer_model_in_flight": live.in_flight,
                "balancer_model_max_concurrent_requests": q.max_concurrent_requests,
                "balancer_model_tokens_available": live.tokens_available,
                "balancer_model_token_bucket_capacity": live.token_capacity,
                "balancer_model_tokens_per_60s_allowed": q.allowed_per_minute[0],
                "balancer_model_requests_per_60s_allowed": q.allowed_per_minute[1],
                "balancer_model_window_cap": int(q.window_cap),
                "balancer_model_tokens_per_minute_limit": q.max_tokens_per_minute,
                "balancer_model_requests_available": live.requests_available,
                "balancer_model_requests_per_minute_limit": q.max_requests_per_minute,
                "balancer_model_paused_seconds": live.paused_ms / 1000,
                "balancer_model_effective_max_concurrent_requests": live.cap_now,
                "balancer_model_effective_tokens_per_minute": live.limits.max_tokens_per_minute,
                "balancer_model_effective_requests_per_minute": live.limits.max_requests_per_minute,
                "balancer_model_limits_learned": int(bool(live.limits_reason)),
                "balancer_model_pending_tasks": can_run,
                "balancer_model_pinned_pending_tasks": pinned,
                "balancer_model_tokens_estimated": stats.get("tokens_estimated", 0),
                "balancer_model_tokens_used": stats.get("tokens_used", 0),
                "balancer_model_ready_tasks": live.ready,
                "balancer_model_ready_taken": stats.get("ready_taken", 0),
            }
            for family_name, value in values.items():
                if value is not None:
                    families[family_name].add_metric([name], value)
            for outcome in OUTCOMES:
                families["balancer_model_calls"].add_metric([name, outcome], stats.get(outcome, 0))
            families["balancer_model_call_latency_seconds"].add_metric(
                [name], latency_buckets(stats), stats.get("latency_ms", 0) / 1000
            )
            families["balancer_model_refill_gap_seconds"].add_metric(
                [name], refill_gap_buckets(stats), stats.get("gap_ms", 0) / 1000
            )
        for status, n in {**live_status_counts(svc.engine), **self.finished(svc.engine)}.items():
            families["balancer_tasks"].add_metric([status], n)
        for decision in ("admitted", "not_now", "rejected"):
            families["balancer_admission_decisions"].add_metric([decision], system.get(decision, 0))
        families["balancer_dispatch_rounds"].add_metric([], system.get("dispatch_rounds", 0))
        quotas = svc.quotas.all()  # once: the budgets' prices and the spend's
        standings = read_standings(svc, quotas=quotas)  # once: the ETA's held sources and the per-source budgets
        health = read_health(svc.redis, svc.settings.namespace, view, per_model, standings, left.unfinished,
                             consumers=svc.settings.consumers_required, writebacks=writebacks_by_source(svc.engine))
        drain = estimate_band(svc, view, left, held(standings), health.stopped_models)  # as status reads it
        for name in view:
            present = {r.kind for r in health.models.get(name, [])}
            for kind in kinds("model"):
                families["balancer_model_health"].add_metric([name, kind], int(kind in present))
        for name, reasons in health.sources.items():
            for kind in kinds("source"):
                families["balancer_source_health"].add_metric([name, kind], int(kind in {r.kind for r in reasons}))
        families["balancer_drain_blocked"].add_metric([], int(health.blocked is not None))
        for reason, n in (("budget", 0 if drain is None else drain.waiting), ("no_model", 0 if drain is None else drain.unplaced)):
            families["balancer_drain_left_out_tasks"].add_metric([reason], n)
        if drain is not None and drain.eta is not None and health.blocked is None:  # blocked: no number
            families["balancer_drain_eta_seconds"].add_metric([], drain.eta)
            families["balancer_drain_eta_low_seconds"].add_metric([], drain.low or 0.0)
            families["balancer_drain_eta_high_seconds"].add_metric([], drain.high or 0.0)
        self._money(families, left, quotas)
        add_source_metrics(families, svc.engine, standings)
        return iter(families.values())

    def _money(self, families: dict[str, Any], left: Backlog, quotas: Sequence[Quota]) -> None:
        """Spend so far by model, source and currency (each call at the prices of its start), and the backlog
        left's projected cost by model, in the quotas' currency."""
        prices, named = price_list(quotas)
        currency = named or ""
        for row in self._usage:
            if row.cost is not None:
                families["balancer_spend"].add_metric([row.model, row.source, row.currency or ""], row.cost)
        enabled = {q.name: prices[q.name] for q in quotas if q.enabled}
        projected = project(left.estimates(), self._observed, enabled, currency or None)
        for model, amount in projected.by_model.items():
            families["balancer_backlog_projected_cost"].add_metric([model, currency], amount)

    @staticmethod
    def _families() -> dict[str, Any]:
        model = ["model"]
        gauges = {
            "balancer_model_in_flight": "Calls in flight (live leases)",
            "balancer_model_max_concurrent_requests": "Concurrency cap",
            "balancer_model_tokens_available": "Tokens in the bucket now",
            "balancer_model_token_bucket_capacity": "Token bucket capacity: burst_tokens less the tokens a call in "
                                                    f"transit may still take ({TRANSIT_MS} ms of TPM, at most half the burst)",
            "balancer_model_tokens_per_60s_allowed": "The most tokens any 60 s window may carry: the TPM plus the "
                                                     "burst on top of it (the bucket full at the window's start), "
                                                     "or the TPM alone under a window cap",
            "balancer_model_requests_per_60s_allowed": "The most requests any 60 s window may carry: the RPM plus its "
                                                       "burst, or the RPM alone under a window cap (models with an RPM)",
            "balancer_model_window_cap": "1: the quota's window cap is on (no 60 s window above its TPM/RPM, no burst on top)",
            "balancer_model_tokens_per_minute_limit": "TPM quota",
            "balancer_model_requests_available": "Requests in the bucket now (models with an RPM quota); below 0 while "
                                                  "the start gate is booked ahead: about that many calls wait for their start",
            "balancer_model_requests_per_minute_limit": "RPM quota (models that have one)",
            "balancer_model_paused_seconds": "How much longer a 429 holds the model",
            "balancer_model_effective_max_concurrent_requests": "Concurrency cap in force (learned, or slow start's; <= the quota's)",
            "balancer_model_effective_tokens_per_minute": "TPM in force (learned from 429s and limit headers; <= the quota's)",
            "balancer_model_effective_requests_per_minute": "RPM in force (learned, or discovered from limit headers)",
            "balancer_model_limits_learned": "1 while the limits in force differ from the quota (see `balancer status`)",
            "balancer_model_pending_tasks": "Pending tasks this model may run",
            "balancer_model_pinned_pending_tasks": "Pending tasks pinned to this model alone",
            "balancer_model_ready_tasks": "Tasks on the model's ready list, waiting for its next free slot",
        }
        families: dict[str, Any] = {n: GaugeMetricFamily(n, doc, labels=model) for n, doc in gauges.items()}
        families["balancer_model_calls"] = CounterMetricFamily(
            "balancer_model_calls", "Backend calls by outcome: solved (answered), rate_limited (429), "
            "transient (5xx, timeout, unexpected), failed (other 4xx)", labels=["model", "outcome"])
        families["balancer_model_tokens_estimated"] = CounterMetricFamily(
            "balancer_model_tokens_estimated", "Tokens admitted for answered calls (prompt + max_tokens)", labels=model)
        families["balancer_model_tokens_used"] = CounterMetricFamily(
            "balancer_model_tokens_used", "Tokens answered calls used (prompt + completion)", labels=model)
        families["balancer_model_ready_taken"] = CounterMetricFamily(
            "balancer_model_ready_taken", "Calls a finishing call's slot took straight from the ready list "
            "(no dispatcher round between the two calls)", labels=model)
        families["balancer_model_call_latency_seconds"] = HistogramMetricFamily(
            "balancer_model_call_latency_seconds", "Latency of answered calls", labels=model)
        families["balancer_model_refill_gap_seconds"] = HistogramMetricFamily(
            "balancer_model_refill_gap_seconds", "How long a slot freed by a model at its cap waited for the "
            "model's next admission (an idle backlog shows as long gaps)", labels=model)
        families["balancer_tasks"] = GaugeMetricFamily(
            "balancer_tasks", "Tasks by status (solved, failed and cancelled recounted at most once a minute)",
            labels=["status"])
        families["balancer_admission_decisions"] = CounterMetricFamily(
            "balancer_admission_decisions",
            "Admission decisions by kind (admitted: by a dispatch round, its ready-list pass, or a finishing call's slot)",
            labels=["decision"])
        families["balancer_dispatch_rounds"] = CounterMetricFamily(
            "balancer_dispatch_rounds", "Admission rounds (admit calls) run by dispatchers")
        families["balancer_drain_eta_seconds"] = GaugeMetricFamily(
            "balancer_drain_eta_seconds", "Predicted seconds until the backlog is solved (balancer.views.eta)")
        families.update(source_families())
        families["balancer_model_health"] = GaugeMetricFamily(
            "balancer_model_health", "1 while the reason holds for the model (`balancer status` says it with the "
            "detail): " + "; ".join(f"{k}: {REASONS[k][0]}" for k in kinds("model")), labels=["model", "reason"])
        families["balancer_source_health"] = GaugeMetricFamily(
            "balancer_source_health", "1 while the reason holds for the source (sources with a reason only): "
            + "; ".join(f"{k}: {REASONS[k][0]}" for k in kinds("source")), labels=["source", "reason"])
        families["balancer_drain_blocked"] = GaugeMetricFamily(
            "balancer_drain_blocked", "1 while tasks wait and no model can run any (the ETA is then not exported)")
        families["balancer_drain_left_out_tasks"] = GaugeMetricFamily(
            "balancer_drain_left_out_tasks", "Pending tasks the drain ETA leaves out, by why: budget (their source's "
            "budget per day is spent), no_model (only models removed, disabled or stopped may take them)",
            labels=["reason"])
        for side in ("low", "high"):
            families[f"balancer_drain_eta_{side}_seconds"] = GaugeMetricFamily(
                f"balancer_drain_eta_{side}_seconds", f"The {side} end of the drain ETA's band (balancer.views.eta)")
        families["balancer_spend"] = CounterMetricFamily(
            "balancer_spend", "Money spent on every call sent (hedges and retries included: the ledger), at the "
            "quotas' prices (recounted with the finished tasks)", labels=["model", "source", "currency"])
        families["balancer_backlog_projected_cost"] = GaugeMetricFamily(
            "balancer_backlog_projected_cost", "Projected cost of the tasks left (balancer.costs.cost.project)",
            labels=["model", "currency"])
        return families


#: The one path metrics are served on; any other is a 404.
METRICS_PATH = "/metrics"


def exposition_app(registry: Any, token: str | None = None, bound: str | None = None) -> Any:
    """The WSGI app of the exporter: :data:`METRICS_PATH` only (404 elsewhere), and with
    ``token``, only for ``Authorization: Bearer <token>`` (compared in constant time; 401).
    With ``bound`` (the address served on), only for a ``Host`` that names it
    (:class:`balancer.httpguard.HostNames`; 400): a page of another site rebound to
    loopback does not read a token-less exporter."""
    import hmac

    from prometheus_client import make_wsgi_app

    metrics = make_wsgi_app(registry)
    expected = f"Bearer {token}".encode() if token else None
    hosts = HostNames(bound) if bound is not None else None

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        def refuse(status: str, text: bytes, *headers: tuple[str, str]) -> list[bytes]:
            start_response(status, [("Content-Type", "text/plain; charset=utf-8"), *headers])
            return [text]

        if hosts is not None and "HTTP_HOST" in environ and not hosts.allows(host_name(environ["HTTP_HOST"])):
            return refuse("400 Bad Request", b"400: this exporter does not answer to that Host name\n")
        if environ.get("PATH_INFO") != METRICS_PATH:
            return refuse("404 Not Found", b"404: metrics are served on /metrics only\n")
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1")
        if expected is not None and not hmac.compare_digest(given, expected):
            return refuse("401 Unauthorized", b"401: these metrics need their token (BALANCER_METRICS_TOKEN)\n",
                          ("WWW-Authenticate", "Bearer"))
        return metrics(environ, start_response)

    return app


def serve(services: Services, host: str, port: int, *, finished_every: float = FINISHED_RECOUNT_S,
          token: str | None = None) -> Any:
    """Start the exporter's HTTP server in a thread (:func:`exposition_app`); returns the server
    (``shutdown()`` to stop). A connection that sends no whole request within
    :data:`READ_TIMEOUT_S` of opening is closed, however it trickles its bytes."""
    import socket
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(BalancerCollector(services, finished_every=finished_every))

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Quiet(WSGIRequestHandler):
        timeout = READ_TIMEOUT_S  # each read; the timer below bounds the whole request

        def setup(self) -> None:
            super().setup()
            self.deadline = threading.Timer(READ_TIMEOUT_S, self.too_slow)
            self.deadline.daemon = True
            self.deadline.start()

        def too_slow(self) -> None:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def parse_request(self) -> bool:  # the request line and headers are in: a scrape has no body
            whole = super().parse_request()
            self.deadline.cancel()
            return whole

        def finish(self) -> None:
            self.deadline.cancel()
            super().finish()

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            return

    server = make_server(host, port, exposition_app(registry, token, bound=host), Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server

"""The Grafana dashboard for ``balancer metrics``, and a picture of it from a real run.

    python -m balancer.bench.compare.dashboard [--scenario default] [--png docs/img/dashboard.png]
    python -m balancer.bench.compare.dashboard --json-only       # rewrite docs/grafana-dashboard.json

The panels are defined once, as data (:data:`PANELS`). From them come both
the Grafana JSON that ships in ``docs/grafana-dashboard.json`` (import it and
pick your Prometheus data source) and the PNG in ``docs/img/dashboard.png``.
No Grafana runs on this machine, so the PNG is drawn with matplotlib: the run
starts the pipeline on a scenario, scrapes the exporter's ``/metrics`` once a
second, and evaluates each panel's query on those scrapes the way Prometheus
would (``rate`` over a window, ``histogram_quantile`` with linear
interpolation inside a bucket). Same queries, same data, drawn differently.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: One scrape: {(sample name, sorted labels): value}.
Samples = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]
#: Scrapes over time: [(unix seconds, samples)].
History = Sequence[tuple[float, Samples]]

RATE_WINDOW_S = 30.0


@dataclass(frozen=True)
class Query:
    """One line of a panel: a metric, optionally a rate or a quantile, summed by ``by``.

    >>> Query("balancer_model_calls_total", "rate", {"outcome": "solved"}).promql()
    'sum by (model) (rate(balancer_model_calls_total{outcome="solved"}[30s]))'
    >>> Query("balancer_model_call_latency_seconds", "quantile", q=0.99).promql()
    'histogram_quantile(0.99, sum by (model, le) (rate(balancer_model_call_latency_seconds_bucket[30s])))'
    """

    metric: str
    func: str = "value"  # value | rate | quantile
    match: Mapping[str, str] = field(default_factory=dict)
    q: float = 0.5
    by: str = "model"
    legend: str = "{{model}}"

    def selector(self, name: str) -> str:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.match.items()))
        return f"{name}{{{labels}}}" if labels else name

    def promql(self) -> str:
        window = f"[{RATE_WINDOW_S:g}s]"
        if self.func == "rate":
            return f"sum by ({self.by}) (rate({self.selector(self.metric)}{window}))"
        if self.func == "quantile":
            inner = f"rate({self.selector(self.metric + '_bucket')}{window})"
            return f"histogram_quantile({self.q:g}, sum by ({self.by}, le) ({inner}))"
        return f"sum by ({self.by}) ({self.selector(self.metric)})"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana unit id: short, s, reqps ...
    queries: tuple[Query, ...]


PANELS: tuple[Panel, ...] = (
    Panel("Calls in flight (dashed: cap)", "short", (
        Query("balancer_model_in_flight"),
        Query("balancer_model_max_concurrent_requests", legend="cap {{model}}"),
    )),
    Panel("Answered calls per second", "reqps", (
        Query("balancer_model_calls_total", "rate", {"outcome": "solved"}),)),
    Panel("429s and transient failures per second", "reqps", (
        Query("balancer_model_calls_total", "rate", {"outcome": "rate_limited"}, legend="429 {{model}}"),
        Query("balancer_model_calls_total", "rate", {"outcome": "transient"}, legend="transient {{model}}"),
    )),
    Panel("Tokens used per second (dashed: TPM / 60)", "short", (
        Query("balancer_model_tokens_used_total", "rate"),
        Query("balancer_model_tokens_per_minute_limit", legend="limit {{model}}"),
    )),
    Panel("Call latency p50 (dashed: p99)", "s", (
        Query("balancer_model_call_latency_seconds", "quantile", q=0.5),
        Query("balancer_model_call_latency_seconds", "quantile", q=0.99, legend="p99 {{model}}"),
    )),
    Panel("Refill gap p50 (dashed: p99)", "s", (
        Query("balancer_model_refill_gap_seconds", "quantile", q=0.5),
        Query("balancer_model_refill_gap_seconds", "quantile", q=0.99, legend="p99 {{model}}"),
    )),
    Panel("Tasks by status", "short", (
        Query("balancer_tasks", by="status", legend="{{status}}"),)),
    Panel("Drain ETA", "s", (
        Query("balancer_drain_eta_seconds", by="", legend="ETA"),)),
)


# -- Grafana ---------------------------------------------------------------------------

def grafana_json(panels: Sequence[Panel] = PANELS) -> dict[str, Any]:
    """A Grafana dashboard (schema 39) with one time-series panel per :class:`Panel`,
    two per row, on a ``DS_PROMETHEUS`` data source chosen at import."""
    out = []
    for i, panel in enumerate(panels):
        targets = [{"expr": q.promql(), "legendFormat": q.legend, "refId": chr(ord("A") + j),
                    "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}}
                   for j, q in enumerate(panel.queries)]
        out.append({
            "id": i + 1, "type": "timeseries", "title": panel.title,
            "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": targets,
        })
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus"}],
        "title": "balancer", "uid": "balancer", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-30m", "to": "now"}, "refresh": "5s", "tags": ["balancer"],
        "templating": {"list": []}, "panels": out,
    }


# -- evaluating a query on scrapes, as Prometheus would ------------------------------------

def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative ``(le, count)`` pairs
    (``math.inf`` last): linear interpolation inside the bucket that holds the
    rank; the highest finite edge when the rank is in the +Inf bucket.

    >>> round(histogram_quantile(0.5, [(0.1, 2.0), (0.2, 6.0), (math.inf, 8.0)]), 9)
    0.15
    >>> histogram_quantile(0.99, [(0.1, 2.0), (0.2, 6.0), (math.inf, 8.0)])
    0.2
    >>> histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    True
    """
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_edge, lower_count = 0.0, 0.0
    for edge, count in buckets:
        if count >= rank:
            if math.isinf(edge):
                return lower_edge
            if count == lower_count:
                return edge
            return lower_edge + (edge - lower_edge) * (rank - lower_count) / (count - lower_count)
        lower_edge, lower_count = edge, count
    return lower_edge


def _matching(samples: Samples, name: str, match: Mapping[str, str]) -> Iterator[tuple[dict[str, str], float]]:
    for (sample, labels), value in samples.items():
        if sample == name:
            d = dict(labels)
            if all(d.get(k) == v for k, v in match.items()):
                yield d, value


def _before(history: History, i: int, window: float) -> int:
    """Index of the latest scrape at least ``window`` seconds before scrape ``i`` (or the first)."""
    t = history[i][0] - window
    j = i
    while j > 0 and history[j][0] > t:
        j -= 1
    return j


def evaluate(query: Query, history: History) -> dict[str, list[tuple[float, float]]]:
    """Each series of ``query`` over the scrapes: {label value: [(t, value)]}.

    >>> h = [(0.0, {("c_total", (("model", "a"),)): 0.0}), (10.0, {("c_total", (("model", "a"),)): 20.0})]
    >>> evaluate(Query("c_total", "rate"), h)
    {'a': [(10.0, 2.0)]}
    """
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for i, (t, samples) in enumerate(history):
        if query.func == "value":
            sums: dict[str, float] = defaultdict(float)
            for labels, value in _matching(samples, query.metric, query.match):
                sums[labels.get(query.by, "")] += value
            for key, value in sums.items():
                series[key].append((t, value))
            continue
        j = _before(history, i, RATE_WINDOW_S)
        if j == i:
            continue  # a rate needs two scrapes
        t0, old = history[j]
        name = query.metric + ("_bucket" if query.func == "quantile" else "")
        rates: dict[tuple[str, str], float] = defaultdict(float)
        previous = {(tuple(sorted(d.items()))): v for d, v in _matching(old, name, query.match)}
        for labels, value in _matching(samples, name, query.match):
            before = previous.get(tuple(sorted(labels.items())), 0.0)
            increase = value - before if value >= before else value  # a counter reset
            rates[(labels.get(query.by, ""), labels.get("le", ""))] += increase / (t - t0)
        if query.func == "rate":
            for (key, _), value in rates.items():
                series[key].append((t, value))
            continue
        by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for (key, le), value in rates.items():
            by_key[key].append((math.inf if le == "+Inf" else float(le), value))
        for key, buckets in by_key.items():
            value_q = histogram_quantile(query.q, buckets)
            if value_q is not None:
                series[key].append((t, value_q))
    return dict(series)


# -- a real run -------------------------------------------------------------------------

def render(history: History, out: Path, title: str, panels: Sequence[Panel] = PANELS) -> None:
    """Draw every panel from the scrapes (matplotlib), two per row, as Grafana lays them out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(15, 3.3 * rows), squeeze=False)
    start = history[0][0] if history else 0.0
    colours: dict[str, Any] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        for k, query in enumerate(panel.queries):
            for key, points in sorted(evaluate(query, history).items()):
                if not points:
                    continue
                colour = colours.setdefault(key, cycle[len(colours) % len(cycle)])
                xs = [p[0] - start for p in points]
                ys = [p[1] / 60 if query.metric.endswith("per_minute_limit") else p[1] for p in points]
                ax.plot(xs, ys, color=colour, linestyle="--" if k else "-", linewidth=1.2 if k else 1.6,
                        label=key if k == 0 else None)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=5, loc="upper right")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def run(scenario_name: str, png: Path, every: float = 1.0) -> int:
    """Run the pipeline on a scenario with the exporter, scrape it every ``every``
    seconds, and draw the dashboard; returns the number of scrapes."""
    import tempfile

    from rich.console import Console

    from balancer.bench.compare.bounds import GRACE
    from balancer.bench.scenarios import locate
    from balancer.devtools.embedded import free_port
    from balancer.devtools.runner import IsolatedServices, run_pipeline
    from balancer.devtools.scenario import parse_scenario
    from balancer.supervisor import wait_for_http

    console = Console()
    name, text = locate(scenario_name)
    scenario = parse_scenario(text, name)
    path = Path(tempfile.mkdtemp(prefix="balancer-dashboard-")) / name
    path.write_text(text, encoding="utf-8")
    history: list[tuple[float, Samples]] = []
    stop = threading.Event()
    with IsolatedServices(console, "dashboard") as iso:
        exporter_supervisor = iso.supervisor()
        port = free_port()
        exporter = exporter_supervisor.start("metrics", ["metrics", "--port", str(port)])
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for_http(url, child=exporter)

        def scraping() -> None:
            while not stop.wait(every):
                try:
                    history.append((time.time(), scrape(url)))
                except Exception as exc:  # noqa: BLE001 - a missed scrape is a gap in the picture, as in Prometheus
                    console.print(f"scrape failed: {exc}")

        thread = threading.Thread(target=scraping, daemon=True)
        thread.start()
        try:
            result = run_pipeline(iso, quotas=scenario.quotas(), sim_args=["--scenario", str(path), "--seed",
                                  str(scenario.seed), "--grace", str(GRACE)], backlog_jsonl=scenario.backlog_jsonl(),
                                  console=console)
        finally:
            stop.set()
            thread.join(timeout=10)
            exporter_supervisor.stop_all()
    solved = result.counts.get("solved", 0)
    render(history, png, f"balancer: {name}, {solved} prompts solved in {result.makespan:.0f} s "
                         f"(scraped every {every:g} s from `balancer metrics`)")
    console.print(f"{len(history)} scrapes; dashboard drawn to {png}")
    return len(history)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="default")
    parser.add_argument("--png", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--json", type=Path, default=Path("docs/grafana-dashboard.json"))
    parser.add_argument("--json-only", action="store_true", help="Only write the Grafana JSON.")
    args = parser.parse_args(argv)
    args.json.write_text(json.dumps(grafana_json(), indent=2) + "\n")
    if not args.json_only:
        run(args.scenario, args.png)


if __name__ == "__main__":
    main()

"""The PNG plots of a ``balancer bench`` run: tokens, requests and calls in flight
per model and side over time, each against its provider's limit (matplotlib)."""

from __future__ import annotations

from pathlib import Path

from balancer.bench.compare.bounds import limits
from balancer.bench.compare.report import backlog_out, last_task_start, rolling_series
from balancer.devtools.runner import RunResult
from balancer.devtools.scenario import Scenario


def plot(results: dict[str, RunResult], scenario: Scenario, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lim = limits(scenario)
    names = [m.name for m in scenario.models]
    window = 60 * scenario.time_scale  # one scenario minute
    files = []
    for metric, label, limit_of in (
        ("tokens", "tokens per (scaled) minute", lambda limit: limit.tpm * scenario.time_scale),
        ("requests", "requests per (scaled) minute", lambda limit: (limit.rpm or 0) * scenario.time_scale),
        ("in_flight", "calls in flight", lambda limit: limit.cap),
    ):
        fig, axes = plt.subplots(len(names), len(results), figsize=(6 * len(results), 1.6 * len(names)), squeeze=False, sharex="col")
        for col, (side, result) in enumerate(results.items()):
            for row, name in enumerate(names):
                series = rolling_series(result.entries, name, t0=result.started, t1=max(result.finished, result.started + 1),
                                        window=window)
                ax = axes[row][col]
                ax.plot(series["t"], series[metric], lw=1)
                out_at = last_task_start(result.rows) or backlog_out(result.entries)
                if metric == "in_flight" and out_at is not None:  # the backlog ran out: the tail starts
                    ax.axvline(out_at - result.started, color="grey", lw=0.8, ls=":")
                cap = limit_of(lim[name])
                if cap:
                    ax.axhline(cap, color="red", lw=0.8, ls="--")
                ax.set_ylabel(name, fontsize=7)
                ax.tick_params(labelsize=6)
                if row == 0:
                    ax.set_title(f"{side}: {label} (red: limit)", fontsize=8)
            axes[-1][col].set_xlabel("seconds since submit", fontsize=7)
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        files.append(path.name)
    return files

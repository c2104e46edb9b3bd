"""Replay a bench run's recorded ETA polls with the current estimator, or a variant of its early latency.

``balancer bench`` records every ETA poll with the whole state it was computed
from (``pipeline-eta.jsonl``) and the backend's call log (``pipeline-calls.jsonl``).
This replays :func:`balancer.views.eta.forecast` on each poll and judges it as
the report does (:func:`balancer.bench.compare.report.polled_eta_errors`). A model on its
prior gets its early latency from the call log at the poll's moment (answered
calls and running calls' ages), so runs recorded before the state carried
``early_calls`` replay too; ``--variant`` swaps the early mean's formula::

    python -m balancer.bench.compare.eta_replay bench-out/default bench-out/tail --variant shrink
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from balancer.bench.compare.report import polled_eta_errors
from balancer.estimates.capacity import ModelCapacity
from balancer.estimates.latency import MIN_SAMPLES, early_mean_s
from balancer.settings import Settings
from balancer.views import eta

#: The ready lists' TTL the runs were recorded with (BALANCER_READY_TTL's default).
READY_TTL_S = Settings.ready_ttl

#: The early mean's formulas, from the prior's mean, the answered calls (count, seconds) and the running calls' ages.
EarlyMean = Callable[[float, int, float, Sequence[float]], float]
VARIANTS: dict[str, EarlyMean] = {
    "prior": lambda prior, n, seconds, ages: prior,
    "current": lambda prior, n, seconds, ages: early_mean_s(prior, n, seconds, len(ages), sum(ages)),
    "shrink": lambda prior, n, seconds, ages: (MIN_SAMPLES * prior + seconds) / (MIN_SAMPLES + n),
    "posterior": lambda prior, n, seconds, ages: (MIN_SAMPLES * prior + seconds + sum(ages)) / (MIN_SAMPLES + n),
}


def _state(recorded: dict[str, Any], own_tokens: bool, ready_ttl_s: float | None,
           spread: bool = True) -> eta.DrainState:
    # Each model at its own tokens per task as recorded (summary.drain_inputs), or with
    # ``own_tokens`` off at the backlog's mean, as the ETA read it before; with ``spread``
    # off, or recorded before it was read, at a fixed latency's dispersion (1.0).
    models = {name: ModelCapacity(m["concurrency"], m["mean_latency"], m["tpm"], m["burst"], m["rpm"],
                                  m["request_burst"], m.get("tokens_per_task") if own_tokens else None,
                                  m.get("latency_dispersion", 1.0) if spread else 1.0)
              for name, m in recorded["models"].items()}
    buckets = recorded.get("start_buckets")

    def groups(key: str) -> list[tuple[Any, int]]:
        return [(g[0], g[1]) for g in recorded.get(key, [])]

    return eta.DrainState(models, groups("groups"), recorded["in_flight"], recorded["tokens_per_task"],
                          groups("solved"), recorded["window_s"], recorded["on_prior"],
                          {k: tuple(v) for k, v in buckets.items()} if buckets else None, recorded["unfinished"],
                          recorded["solved_by_model"], recorded.get("ready", {}), groups("waiting"),
                          ready_ttl_s=ready_ttl_s)


def replay(run: Path, early: EarlyMean, own_tokens: bool = True, ready_ttl_s: float | None = READY_TTL_S,
           full_pace: bool = False, spread: bool = True) -> list[dict[str, Any]]:
    """Each mark's judged poll (as the report judges it) with the ETA replayed under ``early``,
    with each model's own tokens per task or (``own_tokens`` off) the backlog's mean, each
    ready list counted as its model's work up to what it finishes in ``ready_ttl_s`` (None: all),
    with ``full_pace`` the pace over the whole last minute, as before the pace's window
    stopped at a learned limit's change (``state_full_pace``, recorded when they differ), and
    with ``spread`` off every latency as if fixed (the end tail half a mean call, as before)."""
    polls = [json.loads(line) for line in (run / "pipeline-eta.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in (run / "pipeline-calls.jsonl").read_text().splitlines()]
    makespan = polls[0]["makespan_s"]
    total = polls[0]["done"] + polls[0]["state"]["unfinished"]
    # The call log's clock at the run's start; a call still running at the end ("unfinished") ends
    # when the bench read it, after the last answer.
    started = max(c["end"] for c in calls if not c.get("unfinished")) - makespan
    replayed = []
    for poll in polls:
        if poll["state"] is None:
            replayed.append(poll)
            continue
        recorded = poll.get("state_full_pace") if full_pace and poll.get("state_full_pace") else poll["state"]
        state, now = _state(recorded, own_tokens, ready_ttl_s, spread), started + poll["at_s"]
        models = dict(state.models)
        for name in state.on_prior:
            answered = [c["end"] - c["start"] for c in calls
                        if c["model"] == name and c["status"] == 200 and c["end"] <= now]
            ages = [now - c["start"] for c in calls if c["model"] == name and c["start"] <= now < c["end"]]
            models[name] = replace(models[name], mean_latency=early(models[name].mean_latency, len(answered),
                                                                    sum(answered), ages))
        forecast = eta.forecast(replace(state, models=models, early_calls={}))
        replayed.append({**poll, "eta_s": forecast.eta, "low_s": forecast.low, "high_s": forecast.high})
    return polled_eta_errors(replayed, makespan, total)


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--variant", type=click.Choice(sorted(VARIANTS)), default="current", show_default=True,
              help="The early mean's formula ('prior': as before the early latency).")
@click.option("--tokens", type=click.Choice(["own", "mean"]), default="own", show_default=True,
              help="Each model's tokens per task: its own, as recorded, or the backlog's mean (as before).")
@click.option("--ready-ttl", type=float, default=READY_TTL_S, show_default=True,
              help="Seconds a ready task waits for its model (BALANCER_READY_TTL); 0: every ready task is its model's.")
@click.option("--pace", type=click.Choice(["still", "full"]), default="still", show_default=True,
              help="The pace's window: since the last learned change, or the whole last minute (as before).")
@click.option("--spread", type=click.Choice(["read", "fixed"]), default="read", show_default=True,
              help="Each model's latency spread for the last calls: as its sketch read it, or fixed (as before).")
def main(runs: tuple[Path, ...], variant: str, tokens: str, ready_ttl: float, pace: str, spread: str) -> None:
    """Finish errors at 10/25/50/75 % done of each recorded RUN directory, replayed."""
    for run in runs:
        missing = [name for name in ("pipeline-eta.jsonl", "pipeline-calls.jsonl") if not (run / name).is_file()]
        if missing:
            raise click.UsageError(f"{run} is not a finished bench run: no {', '.join(missing)}")
        rows = replay(run, VARIANTS[variant], own_tokens=tokens == "own", ready_ttl_s=ready_ttl or None,
                      full_pace=pace == "full", spread=spread == "read")
        click.echo(f"{run} ({variant}, {tokens} tokens, ready TTL {ready_ttl:g} s, {pace} pace, {spread} spread): "
                   + "  ".join(f"{r['done']:.0%} {r['finish_error']:+.1%}" for r in rows))


if __name__ == "__main__":
    main()

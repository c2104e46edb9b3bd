"""How far a rule acting on a bench run's tail could take it: its tasks still unanswered when the
backlog ran out, hedged at that moment, on the draws the simulator would really have made.

The simulator draws a call's latency from its model and prompt alone (common random numbers,
:meth:`balancer.devtools.sim.provider.Simulator.call_rng`), so what a hedge on another model
would have taken is known after the run. For each run directory this prints its utilization,
when its backlog ran out, and the utilization it would have reached had every task still
unanswered then been hedged at once (plus ``--delay``) on each of the ``--on`` models, each a
fresh draw, ignoring those models' slots, tokens and the hedge budget: a ceiling for a rule
that acts only once the backlog has run out (one on every model is the best such a rule could
do knowing each draw). ``--on`` defaults to the scenario's two models of shortest median latency::

    python -m balancer.bench.compare.tail_ceiling bench-out/1-A bench-out/2-B
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

from balancer.devtools.scenario import Scenario, parse_scenario
from balancer.devtools.sim.provider import Simulator, prompt_key


def answered_at(entries: Iterable[dict[str, Any]]) -> dict[str, float]:
    """When each task (by its prompt's key) was answered: the end of its first call to end with
    an answer (a 200 the client did not leave: not a hedge's cancelled loser, nor a call still
    running when the run was read).

    >>> answered_at([dict(prompt_key="a", start=0, end=9, status=200, client_gone=True),
    ...              dict(prompt_key="a", start=3, end=4, status=200), dict(prompt_key="b", start=0, end=2, status=429),
    ...              dict(prompt_key="c", start=0, end=5, status=0, unfinished=True)])
    {'a': 4}
    """
    out: dict[str, float] = {}
    for e in entries:
        if e["status"] == 200 and not e.get("client_gone"):
            out[e["prompt_key"]] = min(out.get(e["prompt_key"], e["end"]), e["end"])
    return out


def hedged_end(answered: Mapping[str, float], out_at: float, draws: Mapping[str, Sequence[float]],
               delay: float) -> float:
    """The last answer had every task unanswered at ``out_at`` been hedged then (+ ``delay``),
    once on each model whose latency for that task is in ``draws``: the sooner of its own
    answer and the best hedge.

    >>> answered = {"a": 3.0, "b": 12.0, "c": 10.5}
    >>> hedged_end(answered, 10.0, {"b": [0.5, 4.0], "c": [2.0]}, 0.1)   # b at 10.6; c's own answer (10.5) is sooner
    10.6
    >>> hedged_end(answered, 10.0, {}, 0.1)                              # no draws: the run as it was
    12.0
    """
    ends = [end if end <= out_at or not draws.get(key) else min(end, out_at + delay + min(draws[key]))
            for key, end in answered.items()]
    return max(ends)


def fastest_models(scenario: Scenario, count: int) -> list[str]:
    """The ``count`` models of shortest median latency."""
    return [m.name for m in sorted(scenario.models, key=lambda m: (m.latency.median, m.name))[:count]]


def ceilings(run: Path, on: Sequence[str], delay: float) -> dict[str, Any]:
    """A run directory's utilization as it was, and with its tail hedged on the first model of
    ``on``, on all of ``on``, and on every model."""
    report = json.loads((run / "report.json").read_text())
    toml = next(run.glob("*.toml"))
    scenario = parse_scenario(toml.read_text(), toml.stem)
    entries = [json.loads(line) for line in (run / "pipeline-calls.jsonl").read_text().splitlines() if line]
    # The report's times count from the submit, before the first call reached the backend: read
    # the call log on that clock, its last answer at the run's makespan (a run with nothing to
    # hedge keeps its own utilization; the write after that answer shifts the rest by its ms).
    answers = answered_at(entries)
    started = max(answers.values()) - report["makespan_s"]["pipeline"]
    answered = {key: end - started for key, end in answers.items()}
    out_at = report["pipeline"]["backlog_out_s"]
    sim = Simulator(list(scenario.models), time_scale=scenario.time_scale, seed=scenario.seed)
    lines = {prompt_key(line["prompt"]): line for line in scenario.task_lines()}
    targets = list(on) or fastest_models(scenario, 2)
    bound = report["makespan_s"]["bound"]

    def utilization(models: Sequence[str]) -> float:
        draws: dict[str, list[float]] = defaultdict(list)
        for key, end in answered.items():
            if end > out_at and key in lines:
                line = lines[key]
                draws[key] = [sim.draw(m, line["prompt"], line["max_tokens"])[0] for m in models]
        return round(bound / hedged_end(answered, out_at, draws, delay), 3)

    return {"run": run.name, "utilization": report["utilization"], "backlog_out_s": out_at,
            "open_at_out": sum(1 for end in answered.values() if end > out_at),
            "one": utilization(targets[:1]), "all_on": utilization(targets),
            "every_model": utilization([m.name for m in scenario.models]), "on": targets}


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--on", "on", multiple=True, help="a model to hedge on (repeat; default: the two fastest by median)")
@click.option("--delay", default=0.05, show_default=True, help="seconds from the backlog's end to the hedges' start")
def main(runs: tuple[Path, ...], on: tuple[str, ...], delay: float) -> None:
    """Print each run's utilization, and what it would have been with its tail hedged at once."""
    rows = [ceilings(run, on, delay) for run in runs]
    names = rows[0]["on"]
    click.echo(f"| run | utilization | backlog out (s) | unanswered then | hedged on {names[0]} | on "
               f"{' + '.join(names)} | on every model |")
    click.echo("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        click.echo(f"| {r['run']} | {r['utilization']} | {r['backlog_out_s']} | {r['open_at_out']} | {r['one']} "
                   f"| {r['all_on']} | {r['every_model']} |")
    if len(rows) > 1:
        means = [round(sum(r[k] for r in rows) / len(rows), 3) for k in ("utilization", "one", "all_on", "every_model")]
        click.echo(f"| mean of {len(rows)} | {means[0]} | | | {means[1]} | {means[2]} | {means[3]} |")


if __name__ == "__main__":
    main()

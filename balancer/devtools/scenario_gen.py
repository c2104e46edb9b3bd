"""A scenario nobody tuned anything on: models and a workload drawn from a seed (pure).

``python -m balancer.devtools.scenario_gen --seed 2026 > gen-2026.toml`` then
``balancer bench gen-2026.toml``. Each model gets a concurrency from 2 to 24,
a lognormal latency whose median is drawn from 1.5 s to 25 s (log-uniform)
and whose p99 is 4 to 15 times that (clipped to [1, 120] s: heavy-tailed), and
one binding limit drawn among concurrency, tokens per minute and requests per
minute. The workload's token sizes, pinned share, priorities and sources are
drawn too, and each model's prices (a ``[prices]`` table, for the bench's cost
projection). The same seed always gives the same text. ``--short 20`` draws
the short profile instead (:func:`generate_short`): a bound of about 20 s.

>>> text = generate(7)
>>> text == generate(7), text == generate(8)
(True, False)
>>> from balancer.devtools.scenario import parse_scenario
>>> s = parse_scenario(text)
>>> len(s.models), s.workload.tasks, all(1.0 <= m.latency.low and m.latency.high <= 120 for m in s.models)
(10, 2000, True)
"""

from __future__ import annotations

import argparse
import math
import random


def _model(rng: random.Random, i: int, prompt_median: int, output_median: int) -> list[str]:
    cap = rng.randint(2, 24)
    median = round(math.exp(rng.uniform(math.log(1.5), math.log(25.0))), 1)
    p99 = round(min(120.0, median * rng.uniform(4.0, 15.0)), 1)
    per_call = prompt_median + output_median  # reserved per call, roughly (the provider reserves)
    calls_per_min = cap * 60 / (median * 1.4)  # what the slots allow, with a lognormal's mean above its median
    binding = rng.choice(["concurrency", "concurrency", "tokens", "requests"])
    tpm = int(per_call * calls_per_min * (rng.uniform(0.3, 0.7) if binding == "tokens" else rng.uniform(3, 10)))
    lines = ["", f"[[models]]   # {binding}-bound", f'name = "gen-{i}"', f"max_concurrent_requests = {cap}",
             f"max_tokens_per_minute = {max(12 * per_call, tpm)}"]
    if binding == "requests":
        lines.append(f"max_requests_per_minute = {max(12, int(calls_per_min * rng.uniform(0.3, 0.7)))}")
    if binding == "tokens":
        lines.append(f"burst_tokens = {max(2 * per_call, tpm // rng.choice([2, 4, 6]))}")
    lines.append(f"latency = {{ median = {median}, p99 = {max(p99, median)}, min = 1.0, max = 120.0 }}")
    return lines


#: The short profile's latency medians (seconds, log-uniform) and p99s (times the median).
SHORT_MEDIAN, SHORT_TAIL = (0.4, 4.0), (5.0, 15.0)


def _short_model(rng: random.Random, i: int, per_call: int, binding: str, bound_s: float) -> tuple[list[str], float]:
    """A model of the short profile bound by ``binding``, and the calls it serves in ``bound_s``:
    its slots over its mean latency, or its TPM over the tokens a call reserves (or its RPM) and
    the calls its burst holds, whichever is fewer."""
    cap = rng.randint(2, 16)
    median = round(math.exp(rng.uniform(*map(math.log, SHORT_MEDIAN))), 2)
    p99 = round(min(60.0, median * rng.uniform(*SHORT_TAIL)), 2)
    sigma = math.log(p99 / median) / 2.3263
    slots_rate = cap / (median * math.exp(sigma * sigma / 2))  # a lognormal's mean: median x e^(sigma^2 / 2)
    rate = slots_rate * rng.uniform(0.3, 0.7) if binding != "concurrency" else slots_rate
    tpm = int(per_call * 60 * (rate if binding == "tokens" else slots_rate * rng.uniform(3, 10)))
    lines = ["", f"[[models]]   # {binding}-bound", f'name = "gen-{i}"', f"max_concurrent_requests = {cap}",
             f"max_tokens_per_minute = {max(4 * per_call, tpm)}"]
    burst_calls = 0.0
    if binding == "requests":
        rpm = max(6, int(rate * 60))
        window = rng.choice([1, 10])  # the request bucket: RPM x window / 60 (a minute's would outlast the run)
        lines += [f"max_requests_per_minute = {rpm}", f"rpm_window = {window}"]
        burst_calls = rpm * window / 60
    if binding == "tokens":  # a bucket of 2 to 6 s of its refill: the TPM binds within the run
        burst = max(2 * per_call, tpm * rng.choice([2, 4, 6]) // 60)
        lines.append(f"burst_tokens = {burst}")
        burst_calls = burst / per_call
    lines.append(f"latency = {{ median = {median}, p99 = {max(p99, median)}, min = 0.1, max = 60.0 }}")
    return lines, min(slots_rate * bound_s, rate * bound_s + burst_calls)


def generate_short(seed: int, *, bound_s: float = 20.0, models: int = 10) -> str:
    """A short scenario for ``seed``: ``models`` models, at least two bound by each of
    concurrency, tokens per minute and requests per minute, heavy-tailed latencies (p99 5 to
    15 times a median of 0.4 to 4 s), and about as many tasks as they serve in ``bound_s``
    at their limits (``balancer bench`` reports the real bound). A provider's remaining
    counts are taken at admission (the simulator's default), so each comes one latency old.

    >>> from balancer.devtools.scenario import parse_scenario
    >>> s = parse_scenario(generate_short(11))
    >>> len(s.models), 800 < s.workload.tasks < 4000, generate_short(11) == generate_short(11)
    (10, True, True)
    """
    rng = random.Random(seed)
    prompt_median, output_median = rng.randint(150, 600), rng.randint(80, 300)
    per_call = prompt_median + output_median
    kinds = ["concurrency", "tokens", "requests"] * 2 + [rng.choice(["concurrency", "tokens", "requests"])
                                                         for _ in range(max(0, models - 6))]
    rng.shuffle(kinds)
    drawn = [_short_model(rng, i, per_call, kind, bound_s) for i, kind in enumerate(kinds[:models])]
    tasks = max(100, int(sum(calls for _, calls in drawn)))
    lines = [
        f"# Generated by balancer.devtools.scenario_gen --short with seed {seed}: a bound of about {bound_s:g} s,",
        "# concurrency-, TPM- and RPM-bound models with heavy tails; nothing was tuned on it.",
        f'name = "mix-{seed}"', f"seed = {seed}", "time_scale = 1.0", "baseline_max_seconds = 600", "",
        "[workload]", f"tasks = {tasks}",
        f"prompt_tokens = {{ median = {prompt_median}, p99 = {prompt_median * 3}, min = 20, max = 3000 }}",
        f"output_tokens = {{ median = {output_median}, p99 = {min(1024, output_median * 3)}, min = 16, max = 1024 }}",
        "pinned_fraction = 0.0", "priorities = [0]", 'sources = ["short"]',
    ]
    for model_lines, _ in drawn:
        lines += model_lines
    return "\n".join(lines) + "\n"


def generate(seed: int, *, models: int = 10, tasks: int = 2000, time_scale: float = 1.0) -> str:
    """The scenario's TOML text for ``seed``."""
    rng = random.Random(seed)
    prompt_median, output_median = rng.randint(150, 700), rng.randint(80, 400)
    lines = [
        f"# Generated by balancer.devtools.scenario_gen with seed {seed}: nothing was tuned on it.",
        f'name = "gen-{seed}"', f"seed = {seed}", f"time_scale = {time_scale}", "baseline_max_seconds = 1200", "",
        "[workload]", f"tasks = {tasks}",
        f"prompt_tokens = {{ median = {prompt_median}, p99 = {prompt_median * rng.randint(3, 6)}, min = 20, max = 4000 }}",
        f"output_tokens = {{ median = {output_median}, p99 = {min(1024, output_median * rng.randint(2, 4))}, "
        "min = 16, max = 1024 }",
        f"pinned_fraction = {round(rng.uniform(0.0, 0.1), 3)}",
        "priorities = [0, 0, 1, 2]", 'sources = ["alpha", "beta", "gamma"]',
    ]
    for i in range(models):
        lines += _model(rng, i, prompt_median, output_median)
    prices = random.Random(-seed)  # its own draw: the models above stay as they were before prices existed
    lines += ["", "[prices]", 'currency = "USD"']
    for i in range(models):
        price_in = round(math.exp(prices.uniform(math.log(0.1), math.log(15.0))), 2)
        lines.append(f"gen-{i} = [{price_in}, {round(price_in * prices.choice([2, 3, 4, 5]), 2)}]")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description="Print a scenario drawn from a seed (TOML).")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--short", type=float, metavar="SECONDS",
                        help="the short profile: a bound of about SECONDS, every kind of binding limit (--tasks ignored)")
    args = parser.parse_args()
    if args.short:
        print(generate_short(args.seed, bound_s=args.short, models=args.models), end="")
        return
    print(generate(args.seed, models=args.models, tasks=args.tasks, time_scale=args.time_scale), end="")


if __name__ == "__main__":
    main()

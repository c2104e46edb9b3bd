"""Benchmark scenarios: simulated models and a workload, as TOML (pure, no I/O).

The format is a public interface; docs/scenarios.md documents it. Example::

    name = "short"
    seed = 7
    time_scale = 0.02          # multiplies every latency and every per-minute window

    [workload]
    tasks = 300
    prompt_tokens = { median = 400, p99 = 2000, min = 20, max = 4000 }
    output_tokens = { median = 150, p99 = 600, min = 16, max = 1024 }
    pinned_fraction = 0.1
    priorities = [0, 1, 2]
    sources = ["crm", "web"]

    [[models]]
    name = "model-0"
    max_concurrent_requests = 8
    max_tokens_per_minute = 40000
    max_requests_per_minute = 600          # optional
    burst_tokens = 10000                   # optional, default one minute of TPM
    weight = 1                             # optional
    latency = { median = 4.0, p99 = 30.0, min = 1.0, max = 120.0 }
    error_rate = 0.0                       # optional
    accounting = "reserve"                 # optional: reserve (default, strict) | settle
    rpm_window = 60                        # optional: seconds RPM is checked over (60, 10 or 1)
    headers = true                         # optional: send x-ratelimit-* headers
    foreign_share = 0.0                    # optional: share of the quota another client uses
    on_disconnect = "continue"             # optional: continue (default, strict; "finish" also accepted) | stop: a cancelled call
    real_tokens = 0.1                      # optional: the provider really allows this share of TPM (and token burst)
    real_requests = 0.1                    # optional: ... of RPM (and request burst)
    real_concurrency = 0.1                 # optional: ... of max_concurrent_requests
    limit_changes = [[30, 0.5], [90, 1.0]] # optional: [seconds after the model's first call, factor of the real limits]
    limit_headers = true                   # optional: with headers, send x-ratelimit-limit-* too
    headers_at = "admission"               # optional: remaining counts as the call was admitted (default) | response
"""

from __future__ import annotations

import json
import math
import random
import tomllib
from dataclasses import dataclass, field, fields

from balancer.admission.quota import Quota
from balancer.devtools.sim.config import Z99, Latency, SimModel
from balancer.errors import BalancerError
from balancer.estimates.tokens import estimate_task_tokens


class ScenarioError(BalancerError):
    """A scenario file is malformed; the message names the key."""


@dataclass(frozen=True)
class Distribution:
    """Lognormal by median and p99, clipped to [min, max], as whole numbers."""

    median: float
    p99: float
    min: float
    max: float

    def sample(self, rng: random.Random) -> int:
        sigma = math.log(self.p99 / self.median) / Z99 if self.p99 > self.median else 0.0
        return int(round(min(self.max, max(self.min, self.median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


@dataclass(frozen=True)
class Workload:
    tasks: int
    prompt_tokens: Distribution
    output_tokens: Distribution
    pinned_fraction: float = 0.0
    priorities: tuple[int, ...] = (0,)
    sources: tuple[str, ...] = ("bench",)


@dataclass(frozen=True)
class Scenario:
    name: str
    models: tuple[SimModel, ...]
    workload: Workload
    time_scale: float = 1.0
    seed: int = 0
    kind: str = "makespan"  # makespan | overhead | backlog | sources
    extra: dict = field(default_factory=dict)

    def quotas(self) -> list[Quota]:
        """The quotas balancer is given."""
        return [m.quota(time_scale=self.time_scale) for m in self.models]

    def real_quotas(self) -> list[Quota]:
        """What the providers really allow at the start (the quotas, unless a model sets real_* shares)."""
        return [m.real_quota(time_scale=self.time_scale) for m in self.models]

    def task_lines(self) -> list[dict]:
        """The workload as JSONL-ready dicts, reproducible from ``seed``.

        A prompt of n tokens is n*4 characters (the simulator and the estimator
        both count ~4 characters per token); its index leads it so every
        prompt is distinct.
        """
        rng = random.Random(self.seed)
        names = [m.name for m in self.models]
        lines = []
        for i in range(self.workload.tasks):
            prompt_tokens = self.workload.prompt_tokens.sample(rng)
            line: dict = {
                "prompt": (f"#{i} " + "lorem ipsum dolor sit amet " * (prompt_tokens * 4 // 27 + 1))[: prompt_tokens * 4],
                "max_tokens": max(1, self.workload.output_tokens.sample(rng)),
                "priority": rng.choice(self.workload.priorities),
                "source": rng.choice(self.workload.sources),
            }
            if rng.random() < self.workload.pinned_fraction:
                line["model"] = rng.choice(names)
            lines.append(line)
        return lines

    def check_pinned_fit(self) -> None:
        """Raise ScenarioError when a task pinned to a model needs more tokens than that
        model's ``burst_tokens`` (what admission charges: prompt plus ``max_tokens``): it can
        never be admitted, so the run could never drain."""
        bursts = {q.name: q.burst for q in self.quotas()}
        unfit = [(i, line["model"], estimate_task_tokens(line["prompt"], line["max_tokens"]))
                 for i, line in enumerate(self.task_lines()) if "model" in line]
        unfit = [(i, model, need) for i, model, need in unfit if need > bursts[model]]
        if unfit:
            i, model, need = unfit[0]
            raise ScenarioError(f"{self.name}: {len(unfit)} task(s) pinned to a model can never fit its burst, "
                                f"e.g. task #{i} needs {need:,} tokens on {model} (burst_tokens {bursts[model]:,})")

    def backlog_jsonl(self) -> str:
        return "".join(json.dumps(line) + "\n" for line in self.task_lines())


def _require(table: dict, key: str, kind: type | tuple, where: str):  # noqa: ANN202
    if key not in table:
        raise ScenarioError(f"{where}: missing {key}")
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ScenarioError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _distribution(table: dict, where: str) -> Distribution:
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: expected a table {{median, p99, min, max}}")
    _known_keys(table, Distribution, where)
    values = {f.name: _require(table, f.name, (int, float), where) for f in fields(Distribution)}
    if not 0 < values["min"] <= values["median"] <= values["max"] or values["p99"] < values["median"]:
        raise ScenarioError(f"{where}: need 0 < min <= median <= max and p99 >= median")
    return Distribution(**{k: float(v) for k, v in values.items()})


def _known_keys(table: dict, kind: type, where: str) -> None:
    """A key the scenario does not read is an error, not a setting silently ignored."""
    if not isinstance(table, dict):
        raise ScenarioError(f"{where}: expected a table, got {table!r}")
    unknown = sorted(set(table) - {f.name for f in fields(kind)})
    if unknown:
        raise ScenarioError(f"{where}: unknown key: {', '.join(unknown)} (docs/scenarios.md lists the keys)")


def parse_scenario(text: str, name: str = "scenario") -> Scenario:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{name}: invalid TOML: {exc}") from None
    time_scale = float(data.get("time_scale", 1.0))
    if time_scale <= 0:
        raise ScenarioError("time_scale must be > 0")
    models = []
    if not isinstance(data.get("models", []), list):
        raise ScenarioError("models: expected [[models]] tables")
    for i, m in enumerate(data.get("models", [])):
        where = f"models[{i}]"
        _known_keys(m, SimModel, where)
        latency = _distribution(m.get("latency", {"median": 8, "p99": 90, "min": 1, "max": 120}), f"{where}.latency")
        try:
            model = SimModel(
                name=_require(m, "name", str, where),
                max_concurrent_requests=_require(m, "max_concurrent_requests", int, where),
                max_tokens_per_minute=_require(m, "max_tokens_per_minute", int, where),
                max_requests_per_minute=m.get("max_requests_per_minute"),
                burst_tokens=m.get("burst_tokens"),
                weight=m.get("weight", 1),
                latency=Latency(latency.median, latency.p99, latency.min, latency.max),
                error_rate=float(m.get("error_rate", 0.0)),
                accounting=m.get("accounting", "reserve"),
                rpm_window=float(m.get("rpm_window", 60)),
                headers=bool(m.get("headers", True)),
                foreign_share=float(m.get("foreign_share", 0.0)),
                on_disconnect=m.get("on_disconnect", "continue"),
                real_tokens=float(m.get("real_tokens", 1.0)),
                real_requests=float(m.get("real_requests", 1.0)),
                real_concurrency=float(m.get("real_concurrency", 1.0)),
                limit_changes=tuple((float(at), float(f)) for at, f in m.get("limit_changes", [])),
                limit_headers=bool(m.get("limit_headers", True)),
                headers_at=m.get("headers_at", "admission"),
            )
            model.quota(time_scale=time_scale)  # validates every limit
        except BalancerError as exc:
            raise ScenarioError(f"{where}: {exc}") from None
        if not 0 <= model.error_rate < 1:
            raise ScenarioError(f"{where}.error_rate must be in [0, 1)")
        if model.rpm_window not in (1, 10, 60):
            raise ScenarioError(f"{where}.rpm_window must be 1, 10 or 60 (seconds)")
        if model.headers_at not in ("admission", "response"):
            raise ScenarioError(f"{where}.headers_at must be admission or response, got {model.headers_at!r}")
        if not 0 <= model.foreign_share < 1:
            raise ScenarioError(f"{where}.foreign_share must be in [0, 1)")
        shares = (model.real_tokens, model.real_requests, model.real_concurrency, *(f for _, f in model.limit_changes))
        if not all(0 < share <= 1 for share in shares) or any(at < 0 for at, _ in model.limit_changes):
            raise ScenarioError(f"{where}: real_* shares and limit_changes factors must be in (0, 1], times >= 0")
        models.append(model)
    if not models:
        raise ScenarioError("a scenario needs at least one [[models]] table")
    if len({m.name for m in models}) != len(models):
        raise ScenarioError("model names must be unique")
    wl = data.get("workload", {})
    _known_keys(wl, Workload, "workload")
    workload = Workload(
        tasks=_require(wl, "tasks", int, "workload"),
        prompt_tokens=_distribution(_require(wl, "prompt_tokens", dict, "workload"), "workload.prompt_tokens"),
        output_tokens=_distribution(_require(wl, "output_tokens", dict, "workload"), "workload.output_tokens"),
        pinned_fraction=float(wl.get("pinned_fraction", 0.0)),
        priorities=tuple(wl.get("priorities", [0])),
        sources=tuple(wl.get("sources", ["bench"])),
    )
    if workload.tasks < 1 or not 0 <= workload.pinned_fraction <= 1:
        raise ScenarioError("workload.tasks must be >= 1 and pinned_fraction in [0, 1]")
    kind = data.get("kind", "makespan")
    if kind not in ("makespan", "overhead", "backlog", "sources"):
        raise ScenarioError(f"kind must be makespan, overhead, backlog or sources, got {kind!r}")
    known = {"name", "seed", "time_scale", "kind", "models", "workload"}
    return Scenario(
        name=str(data.get("name", name)),
        models=tuple(models),
        workload=workload,
        time_scale=time_scale,
        seed=int(data.get("seed", 0)),
        kind=kind,
        extra={k: v for k, v in data.items() if k not in known},
    )

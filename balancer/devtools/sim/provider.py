"""The simulated provider behind the Models Backend: its limits, its latency draws, its call log.

As strict as the providers it stands in for, by default: tokens reserved
(prompt + max_tokens) on arrival and kept, no grace above the buckets, RPM
paced over each model's window, 429 with ``Retry-After`` and ``retry-after-ms``,
and ``x-ratelimit-*`` headers on every ``/single`` and OpenAI reply, their remaining
counts taken as the call was admitted (``headers_at``; or as it ends, ``"response"``). Models
with a ``foreign_share`` lose that share of their quota to another client.
A call whose client disconnects runs to its end, holding its slot and charged
in full (``on_disconnect = "continue"``, the default, as providers treat
non-streamed requests; its log entry says ``client_gone``), or, for a model
with ``on_disconnect = "stop"``, ends at once with status 499, its slot free
and only the prompt and the tokens generated so far counted.

The log has a call once it ends; :attr:`Simulator.running` holds the calls
admitted and not yet ended. :mod:`balancer.devtools.sim.server` serves it over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from balancer.devtools.sim.config import SimModel
from balancer.estimates.tokens import heuristic_prompt_tokens

DEFAULT_MAX_TOKENS = 256


def prompt_key(prompt: str) -> str:
    """The key of a prompt in the call log (``prompt_key``): a witness maps calls to tasks by it."""
    return hashlib.blake2b(prompt.encode(), digest_size=8).hexdigest()


@dataclass
class Faults:
    """Injected misbehaviour, per model ('*' = all)."""

    status: dict[str, int] = field(default_factory=dict)  # always answer this status
    hang: dict[str, float] = field(default_factory=dict)  # sleep this long (s), then answer
    malformed: dict[str, bool] = field(default_factory=dict)
    no_usage: dict[str, bool] = field(default_factory=dict)
    retry_after: dict[str, float | None] = field(default_factory=dict)  # with status 429

    def get(self, table: dict, model: str) -> Any:
        return table.get(model, table.get("*"))


class Simulator:
    def __init__(
        self,
        models: list[SimModel],
        *,
        time_scale: float = 1.0,
        seed: int = 0,
        grace: float = 0.0,
        log_path: Path | None = None,
        untagged_draws: bool = False,
    ) -> None:
        self.models = {m.name: m for m in models}
        self.time_scale = time_scale
        self.seed = seed
        self.untagged_draws = untagged_draws
        self.rng = random.Random(seed)  # error draws
        now = time.time()
        self.limiters = {m.name: m.limiter(time_scale=time_scale, grace=grace, now=now) for m in models}
        self.grace = grace
        self.log: list[dict[str, Any]] = []
        #: Calls admitted and not yet ended (the log has a call only once it ends), by a key of
        #: their own: a hedge's loser can run past a run's end, and a reader of the log alone
        #: would see its slot, and its charge, free.
        self.running: dict[int, tuple[dict[str, Any], asyncio.Future | None]] = {}
        self.log_path = log_path
        self._lock = threading.Lock()
        self._round_robin = itertools.cycle(sorted(self.models))
        self.faults = Faults()
        self.foreign_taken: dict[str, float] = {name: 0.0 for name, m in self.models.items() if m.foreign_share > 0}

    async def run_foreign_traffic(self, tick: float = 0.05) -> None:
        """Another client on the same quota: every ``tick`` seconds it takes its share
        of each model's refill (tokens and requests), as far as the buckets allow."""
        while self.foreign_taken:
            await asyncio.sleep(tick)
            now = time.time()
            with self._lock:
                for name in self.foreign_taken:
                    limiter, share = self.limiters[name], self.models[name].foreign_share
                    requests = share * (limiter.rpm or 0) / 60 * tick
                    took, _ = limiter.take_foreign(now, share * limiter.tpm / 60 * tick, requests)
                    self.foreign_taken[name] += took

    def rate_limit_headers(self, model: str, now: float, *, locked: bool = False) -> dict[str, str]:
        """OpenAI-style ``x-ratelimit-*`` headers, if this model sends them (``locked``: the caller holds the lock)."""
        if not self.models[model].headers:
            return {}
        limiter = self.limiters[model]
        with contextlib.nullcontext() if locked else self._lock:
            tokens, requests = limiter.remaining(now)
        headers = {"x-ratelimit-limit-tokens": str(int(limiter.tpm)), "x-ratelimit-remaining-tokens": str(tokens)}
        if requests is not None:
            headers["x-ratelimit-limit-requests"] = str(int(limiter.rpm or 0))
            headers["x-ratelimit-remaining-requests"] = str(requests)
        if not self.models[model].limit_headers:
            return {k: v for k, v in headers.items() if not k.startswith("x-ratelimit-limit-")}
        return headers

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.log.append(entry)
            if self.log_path is not None:
                with self.log_path.open("a") as fh:
                    fh.write(json.dumps(entry) + "\n")

    def call_rng(self, model: str, prompt: str) -> random.Random:
        """The random stream for one (model, prompt): common random numbers.

        Latency and answer length depend on the prompt and the model, not on the
        order calls arrive in. So a task costs the same on a given model in the
        pipeline run and in the baseline run, and in every run of a scenario,
        and the difference between two runs is the scheduling, not the dice. With
        ``untagged_draws``, a leading tag (``"[batch-2] text"``) is not part of the
        prompt's dice: one run can compare a batch with the same batch under a fault.
        """
        if self.untagged_draws and prompt.startswith("["):
            prompt = prompt.partition("] ")[2] or prompt
        key = hashlib.blake2b(f"{self.seed}\0{model}\0{prompt}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(key, "big"))

    def draw(self, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
        """(latency in seconds, completion tokens) of a call, before any fault.

        The benchmark reads this too, to know what a workload will cost.
        """
        dice = self.call_rng(model, prompt)
        completion_tokens = max(1, int(max_tokens * dice.uniform(0.3, 1.0)))
        return self.models[model].latency.sample(dice) * self.time_scale, completion_tokens

    async def call(
        self, model: str, prompt: str, max_tokens: int, endpoint: str, gone: Callable[[], Awaitable[None]] | None = None
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """One model call: (status, body, headers). ``gone`` returns when the client disconnects."""
        spec = self.models.get(model)
        if spec is None:
            return 404, {"error": f"unknown model {model}"}, {}
        limiter = self.limiters[model]
        prompt_tokens = heuristic_prompt_tokens(prompt)
        charge = prompt_tokens + max_tokens
        start = time.time()
        key = prompt_key(prompt)
        forced = self.faults.get(self.faults.status, model)
        if forced == 429:
            retry_after = self.faults.get(self.faults.retry_after, model)
            self.record({"start": start, "end": start, "model": model, "status": 429, "endpoint": endpoint, "injected": True,
                         "prompt_key": key})
            return 429, {"error": "rate limited (injected)"}, {} if retry_after is None else {"Retry-After": f"{retry_after:.3f}"}
        with self._lock:
            accepted, retry_after = limiter.try_start(start, charge)
            # The counts as the limiter admitted the call (headers_at = "admission"): sent with its reply.
            admitted = self.rate_limit_headers(model, start, locked=True) if accepted else {}
        if not accepted:
            self.record({"start": start, "end": start, "model": model, "status": 429, "endpoint": endpoint,
                         "prompt_tokens": prompt_tokens, "charge": charge, "counted": 0, "limit": limiter.refused_by,
                         "available_tokens": round(limiter.tokens, 1), "in_flight": limiter.in_flight,
                         "prompt_key": key})
            headers = {"Retry-After": f"{retry_after:.3f}", "retry-after-ms": str(math.ceil(retry_after * 1000))}
            return 429, {"error": "rate limited"}, {**headers, **self.rate_limit_headers(model, start)}
        drawn_latency, completion_tokens = self.draw(model, prompt, max_tokens)
        status, body = 200, dict[str, Any]()
        # What it counts so far: its reservation, or (if it settles) at least its prompt.
        running = {"start": start, "model": model, "endpoint": endpoint, "prompt_tokens": prompt_tokens,
                   "charge": charge, "counted": prompt_tokens if spec.accounting == "settle" else charge,
                   "prompt_key": key}
        watcher = asyncio.ensure_future(gone()) if gone is not None else None
        with self._lock:
            self.running[id(running)] = (running, watcher)
        latency, cut = drawn_latency, False
        try:
            hang = self.faults.get(self.faults.hang, model)
            latency = hang if hang is not None else drawn_latency
            cut = await run_for(latency, watcher if spec.on_disconnect == "stop" else None)
            if cut:
                status, body = 499, {"error": "client closed request"}
            elif forced:
                status, body = forced, {"error": "injected failure"}
            elif self.rng.random() < spec.error_rate:
                status, body = 500, {"error": "simulated server error"}
            else:
                body = {
                    "answer": f"[{model}] answer to: {prompt[:40]}",
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
                }
                if self.faults.get(self.faults.no_usage, model):
                    del body["usage"]
        finally:
            end = time.time()
            client_gone = gone_so_far(watcher)
            if watcher is not None:
                watcher.cancel()
            if cut:  # what was generated before the client went
                completion_tokens = int(completion_tokens * min(1.0, (end - start) / latency)) if latency > 0 else 0
            used = prompt_tokens + (completion_tokens if status in (200, 499) else 0)
            with self._lock:
                self.running.pop(id(running), None)
                limiter.finish(end, charge - used)
            # What the provider counted against TPM: the reservation, or the usage if it settles.
            counted = used if spec.accounting == "settle" else charge
            self.record({"start": start, "end": end, "model": model, "status": status, "endpoint": endpoint,
                         "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens if status in (200, 499) else 0,
                         "charge": charge, "counted": counted, "client_gone": client_gone, "prompt_key": key})
        return status, body, admitted if spec.headers_at == "admission" else self.rate_limit_headers(model, end)

    def still_running(self) -> list[dict[str, Any]]:
        """The calls admitted and not yet ended, each with whether its client has gone so far (the
        caller holds the lock)."""
        return [{**entry, "client_gone": gone_so_far(watcher)} for entry, watcher in self.running.values()]

    def next_model(self) -> str:
        with self._lock:
            return next(self._round_robin)


def gone_so_far(watcher: asyncio.Future | None) -> bool:
    """Whether a call's client has disconnected so far (its ``gone`` watcher ended; None: not watched)."""
    return watcher is not None and watcher.done() and not watcher.cancelled()


async def run_for(seconds: float, gone: asyncio.Future | None) -> bool:
    """Work on a call for ``seconds``; True if ``gone`` (the client's disconnect) cut it short."""
    working = asyncio.ensure_future(asyncio.sleep(seconds))
    if gone is None:
        await working
        return False
    await asyncio.wait({working, gone}, return_when=asyncio.FIRST_COMPLETED)
    if working.done():
        return False
    working.cancel()
    return True

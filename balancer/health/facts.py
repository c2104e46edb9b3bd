"""The facts behind each model's and source's health (:mod:`balancer.health.reasons`), recorded and read.

A worker records a model's failed call (:func:`note_failure`: its error, whether
it was ever sent, and the model's answered count then), so that a look can say
"backend unreachable: <the error>" without reading the worker's log. The record
stands until a call of the model is answered (the count moved on) or it expires; one
that never reached the backend also ends once a call of any model is answered (a
deployment has one Models Backend, ``BALANCER_BACKEND_URL``: it is reachable again).
:func:`read_health` gathers one look's facts: the live view, that record, the
budgets' standings; the reasons themselves are pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import redis

from balancer.admission import keys
from balancer.admission.live import ModelLive
from balancer.costs.budget import Standing
from balancer.health.reasons import Health, ModelFacts, SourceFacts, assess
from balancer.sources.read_errors import read_errors
from balancer.sources.reads import Writebacks

#: How long a failed call is remembered when nothing answers or fails after it.
FAILURE_TTL_S = 3600


@dataclass(frozen=True)
class Failure:
    error: str
    unsent: bool  # the request never reached the backend (refused, not reached)
    answered: int  # the model's answered calls when it failed
    answered_anywhere: int | None = None  # every model's (:func:`answered_anywhere`); None: not recorded


def answered_anywhere(counters: Mapping[str, Mapping[str, int]]) -> int:
    """Every model's answered calls, from their counters (``solved``).

    >>> answered_anywhere({"a": {"solved": 3}, "b": {"solved": 4, "failed": 1}, "c": {}})
    7
    """
    return sum(c.get("solved", 0) for c in counters.values())


def note_failure(client: redis.Redis, namespace: str, model: str, error: str, *, unsent: bool,
                 anywhere: int | None = None) -> None:
    """Record ``model``'s latest failed call (a failure path only: never on an answered call);
    ``anywhere``: every model's answered calls then, for a call that never reached the backend."""
    answered = int(client.hget(keys.stats(namespace, model), "solved") or 0)
    record = {"error": error[:300], "unsent": unsent, "answered": answered, "anywhere": anywhere}
    client.set(keys.last_failure(namespace, model), json.dumps(record), ex=FAILURE_TTL_S)


def read_failures(client: redis.Redis, namespace: str, names: list[str]) -> dict[str, Failure]:
    """Each model's recorded last failure (those with one)."""
    if not names:
        return {}
    raw = client.mget([keys.last_failure(namespace, n) for n in names])
    out = {}
    for name, value in zip(names, raw, strict=True):
        if value:
            record = json.loads(value)
            anywhere = record.get("anywhere")  # (absent from a record an older worker wrote)
            out[name] = Failure(str(record["error"]), bool(record["unsent"]), int(record["answered"]),
                                None if anywhere is None else int(anywhere))
    return out


def model_facts(view: Mapping[str, ModelLive], counters: Mapping[str, Mapping[str, int]],
                failures: Mapping[str, Failure], consumers: Mapping[str, int] | None = None) -> list[ModelFacts]:
    """Each model's facts: its live state, and its last failure while no call was answered since
    (of any model, for a call that never reached the backend). ``consumers``: the workers consuming
    each model's queue, where a liveness record says so.

    >>> from balancer.admission.quota import Quota
    >>> view = {n: ModelLive(Quota(n, 1, 60_000), 0, 60_000.0, None, 0) for n in ("a", "b")}
    >>> refused = {"a": Failure("ConnectError: refused", unsent=True, answered=0, answered_anywhere=5)}
    >>> [f.unreachable for f in model_facts(view, {"a": {}, "b": {"solved": 5}}, refused)]
    [True, False]
    >>> [f.unreachable for f in model_facts(view, {"a": {}, "b": {"solved": 6}}, refused)]   # b answered since
    [False, False]
    >>> [f.unreachable for f in model_facts(view, {"a": {}}, refused)]   # b's count left the sum: no answer since
    [True, False]
    """
    everywhere = answered_anywhere(counters)
    facts = []
    for name, live in sorted(view.items()):
        failure = failures.get(name)
        if failure is not None and (counters.get(name, {}).get("solved", 0) != failure.answered
                                    or failure.unsent and failure.answered_anywhere is not None
                                    and everywhere > failure.answered_anywhere):
            failure = None  # a call was answered since: it is over
        facts.append(ModelFacts(
            name, enabled=live.quota.enabled, paused_s=live.paused_ms / 1000, circuit_open=live.circuit_open,
            failures=live.failures, last_error=None if failure is None else failure.error,
            unreachable=failure is not None and failure.unsent,
            consumers=None if consumers is None else consumers.get(name, 0)))
    return facts


def source_facts(budgets: Mapping[str, Standing], writebacks: Mapping[str, Writebacks] | None = None,
                 read_errors: Mapping[str, str] | None = None) -> list[SourceFacts]:
    """Each source's facts: its budgets' standing, its write-backs in trouble (each declared
    source's: :func:`balancer.sources.reads.writebacks_by_source`), and its table's last failed
    read (:func:`balancer.sources.read_errors.read_errors`)."""
    writebacks, read_errors = writebacks or {}, read_errors or {}
    facts = []
    for name in sorted(budgets.keys() | writebacks.keys() | read_errors.keys()):
        st = budgets.get(name)
        w = writebacks.get(name, Writebacks())
        facts.append(SourceFacts(
            name, over_budget=None if st is None else "money" if st.money_spent else "tokens" if st.tokens_spent else None,
            unwritable=w.unwritable, unwritable_error=w.unwritable_error, writeback_failing=w.failing,
            writeback_failing_error=w.failing_error, read_error=read_errors.get(name)))
    return facts


def read_health(client: redis.Redis, namespace: str, view: Mapping[str, ModelLive],
                counters: Mapping[str, Mapping[str, int]], budgets: Mapping[str, Standing], unfinished: int, *,
                consumers: bool = False, writebacks: Mapping[str, Writebacks]) -> Health:
    """One look's reasons (:func:`balancer.health.reasons.assess`). With ``consumers``
    (``BALANCER_CONSUMERS_REQUIRED``: the dispatcher sends nothing to a model no worker
    consumes), each model's live consumer count from the view, so one with none says so.
    ``writebacks``: every declared source, with its write-backs in trouble; each one's table's
    last failed read comes from Redis (of a name it does not hold, a source removed: not said)."""
    failures = read_failures(client, namespace, sorted(view))
    counts = {name: m.consumers for name, m in view.items()} if consumers else None
    sources = source_facts(budgets, writebacks, read_errors(client, namespace, writebacks.keys()))
    return assess(model_facts(view, counters, failures, counts), sources, unfinished)

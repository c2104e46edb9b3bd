"""What a call's end tells the admission core: a 429's pause, a transient
failure's circuit breaker, and an answered call's settlement (usage, the
provider's headers, latency); and a failed call's record for the model's health."""

from __future__ import annotations

import logging
import math

from balancer.admission import AdmissionCore, Settlement
from balancer.backends import Completion, Permanent, RateLimited, Transient
from balancer.pipeline.health import note_failure
from balancer.storage.statements import SolveContext

log = logging.getLogger(__name__)


def trip(core: AdmissionCore, model: str, error: str) -> bool:
    """Tell the model's circuit breaker about a transient failure; True if it
    counts against the task (the circuit was closed and stays closed)."""
    counted, opened = core.trip(model)
    if opened:
        log.warning("%s: circuit open after repeated transient failures (%s); pausing it, then probing", model, error)
    return counted


def note_failed(core: AdmissionCore, model: str, exc: Transient | Permanent) -> None:
    """Record the failed call for ``model``'s health (``status`` says "backend unreachable: ..."
    without the worker's log); a lost Redis here must not change the call's outcome."""
    try:
        note_failure(core.redis, core.namespace, model, str(exc),
                     unsent=isinstance(exc, Transient) and exc.ended == "unsent")
    except Exception:  # noqa: BLE001 - observation only
        log.warning("could not record %s's failed call for its health", model, exc_info=True)


def pause_for(core: AdmissionCore, model: str, exc: RateLimited, admission_id: str | None = None) -> None:
    """Pause the model for the 429's Retry-After (1 s if absent) and sync to its headers;
    ``admission_id``: the refused call's (its lease tells which calls had started before it)."""
    retry_after = exc.retry_after if exc.retry_after is not None else 1.0
    core.penalize(model, math.ceil(retry_after * 1000), exc.remaining.tokens, exc.remaining.requests,
                  limit_tokens=exc.remaining.limit_tokens, limit_requests=exc.remaining.limit_requests,
                  refused=admission_id)


def answered(completion: Completion, ctx: SolveContext, latency_ms: int) -> Settlement:
    """What an answered call tells the admission core (usage, headers, latency)."""
    return Settlement(
        used_tokens=completion.total_tokens,
        reserved_tokens=completion.prompt_tokens + ctx.max_tokens,
        remaining_tokens=completion.remaining.tokens,
        remaining_requests=completion.remaining.requests,
        limit_tokens=completion.remaining.limit_tokens,
        limit_requests=completion.remaining.limit_requests,
        latency_ms=latency_ms,
        completion_tokens=completion.completion_tokens,
    )

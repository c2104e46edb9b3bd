"""What a call's end tells the admission core: a 429's pause, a transient
failure's circuit breaker, and an answered call's settlement (usage, the
provider's headers, latency); and a failed call's record for the model's health."""

from __future__ import annotations

import logging
import math
from dataclasses import replace

from balancer.admission.core import AdmissionCore
from balancer.admission.values import Settlement
from balancer.backends import Completion, Permanent, RateLimited, Transient
from balancer.backlog.statements import SolveContext
from balancer.estimates.tokens import most_prompt_tokens
from balancer.health.facts import answered_anywhere, note_failure
from balancer.settings import Settings

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
    unsent = isinstance(exc, Transient) and exc.ended == "unsent"
    try:
        note_failure(core.redis, core.namespace, model, str(exc), unsent=unsent,
                     anywhere=answered_anywhere(core.counters()[0]) if unsent else None)
    except Exception:  # noqa: BLE001 - observation only
        log.warning("could not record %s's failed call for its health", model, exc_info=True)


def pause_ms(exc: RateLimited, most_s: float) -> int:
    """The pause a 429 asks for, in ms: its Retry-After (1 s if absent or unreadable),
    at most ``most_s`` (``BALANCER_MAX_RETRY_AFTER``): one reply's ``Retry-After: 31536000``
    paused its model for a year, and ``1e306`` overflowed.

    >>> pause_ms(RateLimited("429", 2.5), 60), pause_ms(RateLimited("429", None), 60), pause_ms(RateLimited("429", 1e306), 60)
    (2500, 1000, 60000)
    """
    asked = exc.retry_after if exc.retry_after is not None and math.isfinite(exc.retry_after) else 1.0
    return math.ceil(min(max(asked, 0.0), most_s) * 1000)


def pause_for(core: AdmissionCore, settings: Settings, model: str, exc: RateLimited,
              admission_id: str | None = None) -> None:
    """Pause the model for the 429's Retry-After (:func:`pause_ms`: capped, and a capped one
    logged) and sync to its headers; ``admission_id``: the refused call's (its lease tells
    which calls had started before it)."""
    if exc.retry_after is not None and not exc.retry_after <= settings.max_retry_after:
        log.warning("%s: a 429 asked for a pause of %.6g s; pausing it %g s (BALANCER_MAX_RETRY_AFTER)", model,
                    exc.retry_after, settings.max_retry_after)
    core.penalize(model, pause_ms(exc, settings.max_retry_after), exc.remaining.tokens, exc.remaining.requests,
                  limit_tokens=exc.remaining.limit_tokens, limit_requests=exc.remaining.limit_requests,
                  refused=admission_id)


def believable(completion: Completion, ctx: SolveContext) -> Completion:
    """``completion`` with its reported usage capped at what the call could have used: its
    prompt's :func:`~balancer.estimates.tokens.most_prompt_tokens` and its ``max_tokens``. One
    reply's 3e9 prompt tokens left a reserve model 9.8 h of debt (and overflowed the ledger)."""
    prompt, output = min(completion.prompt_tokens, most_prompt_tokens(ctx.prompt)), min(completion.completion_tokens,
                                                                                          ctx.max_tokens)
    if (prompt, output) == (completion.prompt_tokens, completion.completion_tokens):
        return completion
    log.warning("%d prompt and %d completion tokens reported for a call that could use %d and %d at most: capped",
                completion.prompt_tokens, completion.completion_tokens, most_prompt_tokens(ctx.prompt), ctx.max_tokens)
    return replace(completion, prompt_tokens=prompt, completion_tokens=output)


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

"""How long a worker's consumer record lives, and when the records can be believed.

Each worker process renews a record per model it consumes every :data:`BEAT_MS`
(:mod:`balancer.calls.consumers`, ``consumers.lua``); a record lives :data:`TTL_MS`.
A model with no live record is consumed by nobody, and the dispatcher gives its
queued work to other models. That holds only while Redis hears the workers: when
no worker at all was heard for :data:`SILENCE_MS`, Redis was away (a failover) or
every worker was, and records that lapsed meanwhile say nothing about the
workers. ``consumers.lua`` notes when beats resume after such a silence (or with
no beat on record: Redis lost its data, or no worker beat for a minute), and the
records are believed again once every live worker has had a record's life to
renew its own (:func:`records_trusted`).

>>> records_trusted(10_000, heard_ms=9_500, resumed_ms=None)
True
>>> records_trusted(10_000, heard_ms=9_500, resumed_ms=8_000)   # beats resumed 2 s ago: some may not have renewed yet
False
>>> records_trusted(10_000, heard_ms=7_000, resumed_ms=None)    # no worker heard for 3 s
False
"""

from __future__ import annotations

#: How long a record lives without a renewal: a worker unheard of for this long consumes nothing.
TTL_MS = 3_000
#: How often a worker renews its records (a few renewals may fail before its models look unconsumed).
BEAT_MS = 1_000
#: No worker heard for longer than this: Redis was away, or every worker was (two beats missed).
SILENCE_MS = 2 * BEAT_MS


def records_trusted(now_ms: int, heard_ms: int | None, resumed_ms: int | None) -> bool:
    """Whether a model without a live record can be taken as consumed by nobody: some worker was
    heard within :data:`SILENCE_MS`, and the beats did not resume after a silence within the last
    :data:`TTL_MS`. Never heard of any worker: not trusted (no worker would take the work either)."""
    if heard_ms is None or now_ms - heard_ms > SILENCE_MS:
        return False
    return resumed_ms is None or now_ms - resumed_ms >= TTL_MS

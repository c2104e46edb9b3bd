"""The audit table's record of learned limits (``quota_changes`` rows by ``learned``).

A model's effective limits move on their own (balancer.admission.learned): 429s
lower them, clean windows raise them back. Each sweep tick compares them with
the model's baseline: the last learned row, or the quota itself when an
operator changed the quota after that row (a change by ``quota set`` or an
import is the operator's, never audited again as learned). Where they differ and have stood for
over :data:`STEADY_MS` (so the steps of one recovery are not each a row), writes
one row: action ``learn``, changed_by ``learned``, the limits before and after
(with why they differ from the quota).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Engine

from balancer.admission.live import ModelLive
from balancer.storage import audit
from balancer.storage.schema import quota_changes

#: A learned change is audited once it has lasted this long.
STEADY_MS = 60_000
LEARNED_BY = "learned"
LIMIT_FIELDS = ("max_concurrent_requests", "max_tokens_per_minute", "max_requests_per_minute")


def limits_value(live: ModelLive) -> dict[str, Any]:
    """What a learned row stores: the limits in force, and why they differ from the quota."""
    return {**{f: getattr(live.limits, f) for f in LIMIT_FIELDS}, "reason": live.limits_reason}


def record_learned(engine: Engine, view: Mapping[str, ModelLive], now_ms: int) -> list[str]:
    """Write a row for each model whose limits in force changed since its last
    learned row and have stood for STEADY_MS; returns those models."""
    with engine.begin() as conn:
        # Each model's last change of any kind: the last learned row is the baseline only while
        # no operator's change came after it.
        last = {
            row.model: row.new_value
            for row in conn.execute(audit.last_per_subject(quota_changes))
            if row.changed_by == LEARNED_BY
        }
        written = []
        for name, live in sorted(view.items()):
            now_value = limits_value(live)
            before = last.get(name) or {**{f: getattr(live.quota, f) for f in LIMIT_FIELDS}, "reason": ""}
            if {f: before.get(f) for f in LIMIT_FIELDS} == {f: now_value[f] for f in LIMIT_FIELDS}:
                continue
            changed_at = max(live.learned.lowered_at, live.learned.raised_at)
            if now_ms - changed_at < STEADY_MS:
                continue
            audit.record(conn, quota_changes, name, by=LEARNED_BY, action="learn", old=before, new=now_value)
            written.append(name)
    return written

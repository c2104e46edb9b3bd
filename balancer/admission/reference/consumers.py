"""The reference model of the consumer records: which worker processes consume each model's
queue (``consumers.lua``, ``consumed`` in state.lua), and when Redis last heard any of them
(:mod:`balancer.admission.liveness`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from balancer.admission.liveness import SILENCE_MS


@dataclass
class ConsumerRecords:
    #: Per model, the worker processes consuming its queue: consumer id -> until when (ms).
    records: dict[str, dict[str, int]] = field(default_factory=dict)
    #: When any worker's beat was last heard, and when beats last resumed after a silence (ms).
    heard: int | None = None
    resumed: int | None = None

    def consumed(self, name: str, now: int) -> bool:
        """Whether a worker consumes the model's queue at ``now`` (state.lua, consumed)."""
        return any(until > now for until in self.records.get(name, {}).values())

    def note(self, consumer: str, models: Sequence[str], ttl_ms: int, now: int) -> int:
        """``consumer`` (a worker process) consumes these models' queues until ``now + ttl_ms``
        (0: no more): its beat renews the record. Records past their time are dropped as a
        model's are written. A beat that comes more than ``SILENCE_MS`` after the last one heard
        from any worker, or with none on record, notes that beats resumed. Returns how many models."""
        if ttl_ms > 0:
            if self.heard is None or now - self.heard > SILENCE_MS:
                self.resumed = now
            self.heard = now
        for name in models:
            records = self.records.setdefault(name, {})
            if ttl_ms > 0:
                records[consumer] = now + ttl_ms
            else:
                records.pop(consumer, None)
            for who in [w for w, until in records.items() if until <= now]:
                del records[who]
            if not records:
                del self.records[name]
        return len(models)

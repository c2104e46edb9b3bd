"""The templates' filters: times, durations, the ETA and a quota change, for a person."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from balancer.costs.cost import money


def clock(value: float | datetime | None) -> str:
    """A UTC time (epoch seconds or a datetime) as ``2026-11-23 19:30:05``; ``-`` for none.

    >>> clock(0.0), clock(None)
    ('1970-01-01 00:00:00', '-')
    """
    if value is None:
        return "-"
    moment = datetime.fromtimestamp(value, UTC) if isinstance(value, (int, float)) else value.astimezone(UTC)
    return f"{moment:%Y-%m-%d %H:%M:%S}"


def duration(seconds: float | None) -> str:
    """``45 s``, ``4 min 05 s``, ``2 h 03 min``; a tenth of a second below 10 s (an ETA band
    of 0.8 to 1.3 s read "between 1 s and 1 s").

    >>> duration(45.2), duration(245.2), duration(7380), duration(1.26), duration(None)
    ('45 s', '4 min 05 s', '2 h 03 min', '1.3 s', '-')
    """
    if seconds is None:
        return "-"
    if 0 < seconds < 9.95:
        return f"{seconds:.1f} s"
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def eta(seconds: float | None) -> str:
    """The drain ETA as ``balancer status`` says it: a duration, ``done`` or ``unknown``.

    >>> eta(245.2), eta(0.0), eta(None)
    ('4 min 05 s', 'done', 'unknown')
    """
    if seconds is None:
        return "unknown"
    return "done" if seconds <= 0 else duration(seconds)


def quota_diff(change: Any) -> str:
    """One audit row's change: the fields that differ, ``old → new``.

    >>> quota_diff({"action": "update", "old_value": {"name": "m", "weight": 1, "max_tokens_per_minute": 10},
    ...             "new_value": {"name": "m", "weight": 1, "max_tokens_per_minute": 20}})
    'max_tokens_per_minute 10 → 20'
    >>> quota_diff({"action": "remove", "old_value": {"name": "m"}, "new_value": None})
    'removed'
    """
    old, new = change["old_value"] or {}, change["new_value"] or {}
    if not new:
        return "removed"
    if not old:
        return "created: " + ", ".join(f"{k} {v}" for k, v in new.items() if k != "name" and v is not None)
    return ", ".join(f"{k} {old.get(k)} → {v}" for k, v in new.items() if old.get(k) != v) or "no field changed"


FILTERS = {"clock": clock, "duration": duration, "eta": eta, "quota_diff": quota_diff, "money": money}

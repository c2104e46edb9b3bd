"""Form and query input to validated values: a task filter, a quota change.

Bad input raises :class:`~balancer.errors.BalancerError` (or its
:class:`~balancer.errors.QuotaError`) with a one-line message the page shows;
nothing is changed. Range checks beyond "a positive whole number" stay where
``balancer quota set`` has them (:class:`balancer.admission.quota.Quota`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from balancer.admission.quota import ON_DISCONNECT, TOKEN_ACCOUNTING
from balancer.backlog.operations import TaskFilter
from balancer.errors import BalancerError, QuotaError, printable

#: The filter fields a task search takes, as query or form parameters.
FILTER_FIELDS = ("status", "model", "source", "created_after", "created_before", "task_id")
#: Quota form field -> (Quota field, kind). Kinds: "count" (whole number >= 1), "seconds" and "price"
#: (numbers; Quota checks their range), "currency" (text; Quota checks it), or a tuple of choices.
QUOTA_FIELDS: dict[str, tuple[str, Any]] = {
    "tpm": ("max_tokens_per_minute", "count"),
    "rpm": ("max_requests_per_minute", "count"),
    "concurrency": ("max_concurrent_requests", "count"),
    "weight": ("weight", "count"),
    "burst": ("burst_tokens", "count"),
    "burst_requests": ("burst_requests", "count"),
    "accounting": ("token_accounting", TOKEN_ACCOUNTING),
    "expected_latency": ("expected_latency_s", "seconds"),
    "on_disconnect": ("on_disconnect", ON_DISCONNECT),
    "enabled": ("enabled", ("yes", "no")),
    "window_cap": ("window_cap", ("yes", "no")),
    "price_input": ("price_per_million_input", "price"),
    "price_output": ("price_per_million_output", "price"),
    "currency": ("currency", "currency"),
}


def _given(params: Mapping[str, str], name: str) -> str | None:
    value = (params.get(name) or "").strip()
    return value or None


def _when(name: str, text: str | None) -> datetime | None:
    """An ISO time; a naive one is UTC, as on the command line.

    >>> _when("created_after", "2026-11-21T09:00")
    datetime.datetime(2026, 11, 21, 9, 0, tzinfo=datetime.timezone.utc)
    """
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise BalancerError(f"{name}: not a time like 2026-11-21T09:00 ({printable(text, 40)!r})") from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def task_filter(params: Mapping[str, str]) -> TaskFilter:
    """The task filter in ``params`` (blank fields: any).

    >>> task_filter({"status": "failed", "source": " nightly ", "task_id": ""})
    TaskFilter(status='failed', model=None, source='nightly', created_after=None, created_before=None, task_id=None)
    >>> task_filter({"task_id": "x1"})
    Traceback (most recent call last):
    balancer.errors.BalancerError: task id: not a whole number ('x1')
    """
    key = _given(params, "task_id")
    if key is not None and (not key.isdigit() or len(key) > 18):
        raise BalancerError(f"task id: not a whole number ({printable(key, 40)!r})")
    return TaskFilter(
        status=_given(params, "status"), model=_given(params, "model"), source=_given(params, "source"),
        created_after=_when("created_after", _given(params, "created_after")),
        created_before=_when("created_before", _given(params, "created_before")),
        task_id=None if key is None else int(key),
    )


def filter_params(flt: TaskFilter) -> dict[str, str]:
    """A filter back to form parameters (the confirm page's hidden fields)."""
    return {k: v.isoformat() if isinstance(v, datetime) else str(v) for k, v in vars(flt).items() if v is not None}


def quota_changes(form: Mapping[str, str]) -> dict[str, Any]:
    """The fields of a quota form that were filled in, as ``QuotaStore.set`` takes them.

    >>> quota_changes({"tpm": "90000", "rpm": "", "accounting": "settle", "enabled": "no", "window_cap": "yes"})
    {'max_tokens_per_minute': 90000, 'token_accounting': 'settle', 'enabled': False, 'window_cap': True}
    >>> quota_changes({"concurrency": "0"})
    Traceback (most recent call last):
    balancer.errors.QuotaError: concurrency must be a whole number >= 1, got '0'
    """
    changes: dict[str, Any] = {}
    for name, (field, kind) in QUOTA_FIELDS.items():
        text = _given(form, name)
        if text is None:
            continue
        if kind == "count":
            if not text.isdigit() or int(text) < 1:
                raise QuotaError(f"{name} must be a whole number >= 1, got {printable(text, 40)!r}")
            changes[field] = int(text)
        elif kind in ("seconds", "price"):
            try:
                changes[field] = float(text)
            except ValueError:
                unit = "seconds" if kind == "seconds" else "money per million tokens"
                raise QuotaError(f"{name} must be a number ({unit}), got {printable(text, 40)!r}") from None
        elif kind == "currency":
            changes[field] = text  # Quota checks it: three capital letters
        elif text not in kind:
            raise QuotaError(f"{name} must be one of {', '.join(kind)}, got {printable(text, 40)!r}")
        elif field in ("enabled", "window_cap"):  # the yes/no fields
            changes[field] = text == "yes"
        else:
            changes[field] = text
    if not changes:
        raise QuotaError("nothing to change: fill in at least one field")
    return changes

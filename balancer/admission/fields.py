"""The fields of a model's hash (``keys.model``), declared once.

A quota travels to Redis as :func:`quota_fields` (set_quota.lua and
restore.lua take them in this order, after the model's name) and comes back
as :func:`quota_from_fields` (the live view). The scripts keep the live
state in :data:`STATE_FIELDS`. The script loader prepends :data:`LUA_PRELUDE`,
generated from both, so state.lua loads, creates and saves a model from these
lists and spells no field list itself.

>>> q = Quota("gpt-a", 8, 60_000, max_requests_per_minute=600, on_disconnect="stop")
>>> quota_fields(q)  # doctest: +NORMALIZE_WHITESPACE
{'weight': 1, 'cap': 8, 'tpm': 60000, 'rpm': 600, 'burst': 60000, 'enabled': 1, 'settle': 0, 'rburst': 600,
 'prior': 0, 'stops': 1, 'learn': 1, 'slow_start': 1, 'window_cap': 0}
>>> back = quota_from_fields("gpt-a", quota_fields(q))   # the same limits, defaults spelled out
>>> back.burst_tokens, back.on_disconnect, quota_fields(back) == quota_fields(q)
(60000, 'stop', True)
"""

from __future__ import annotations

from collections.abc import Mapping

from balancer.admission.quota import Quota


def quota_fields(quota: Quota) -> dict[str, int]:
    """A quota as the model hash stores it (integers only), in :data:`QUOTA_FIELDS` order."""
    return {
        "weight": quota.weight,
        "cap": quota.max_concurrent_requests,
        "tpm": quota.max_tokens_per_minute,
        "rpm": quota.max_requests_per_minute or 0,  # 0: no RPM limit
        "burst": quota.burst,  # token bucket capacity
        "enabled": int(quota.enabled),
        "settle": int(quota.settles),  # 1: settle to actual usage, 0: reserve
        "rburst": quota.request_burst,  # request bucket capacity (0 without an RPM limit)
        "prior": prior_ms(quota),  # the latency prior's median in ms (0: the global default)
        "stops": int(quota.on_disconnect == "stop"),  # 1: the provider stops a call whose client went
        "learn": int(quota.learn),  # 1: learn effective limits below these (limits.lua, "Limits that learn")
        "slow_start": int(quota.slow_start),  # 1 (with learn): a new quota's slots open gradually (limits.lua, ramp_cap)
        "window_cap": int(quota.window_cap),  # 1: no 60 s window admits above TPM/RPM (window.lua)
    }


def quota_from_fields(name: str, m: Mapping[str, int]) -> Quota:
    """The quota a model hash holds: the inverse of :func:`quota_fields`."""
    return Quota(
        name=name,
        weight=m["weight"],
        max_concurrent_requests=m["cap"],
        max_tokens_per_minute=m["tpm"],
        max_requests_per_minute=m["rpm"] or None,
        burst_tokens=m["burst"],
        enabled=bool(m["enabled"]),
        token_accounting="settle" if m["settle"] else "reserve",
        burst_requests=m["rburst"] or None,
        expected_latency_s=m["prior"] / 1000 if m["prior"] else None,
        on_disconnect="stop" if m["stops"] else "continue",
        learn=bool(m["learn"]),
        slow_start=bool(m["slow_start"]),
        window_cap=bool(m["window_cap"]),
    )


def prior_ms(quota: Quota) -> int:
    """The latency prior as the model hash stores it: whole ms, 0 for the global default."""
    return round((quota.expected_latency_s or 0) * 1000)


#: The quota's fields, in the order the scripts take them.
QUOTA_FIELDS: tuple[str, ...] = tuple(quota_fields(Quota("x", 1, 1)))

#: The live state the scripts keep beside the quota. A new model starts with
#: each at 0, except the two refill clocks (at now) and the buckets (empty
#: when restored, full when created: restore.lua, set_quota.lua).
STATE_FIELDS: dict[str, str] = {
    "tokens": "the token bucket, units (1/60000 token)",
    "requests": "the request bucket, units",
    "refilled_at": "ms the buckets were last refilled",
    "deficit": "WDRR deficit, tokens",
    "gen": "quota generation: bumped when a rate or bucket size changes",
    "paused": "ms until which a 429 or an open circuit holds the model",
    "tat": "start gate: theoretical arrival time of the next call start, ms",
    "ext": "tokens per minute others use of this quota, learned from the headers (below 0: none, and noise to cancel)",
    "synced_at": "ms of the last x-ratelimit-remaining-tokens sync (0: none since the quota or the token limit changed)",
    "sync_gap": "units the token bucket was below the count less our calls on their way after that sync (<= 0)",
    "ptokens": "the token gate's bucket (as call starts see it), units",
    "started_sum": "estimated tokens of every call started under the model so far (a lease keeps the sum before "
                   "its own: what started after it, for a count taken as the provider admitted it)",
    "prefilled_at": "ms the token gate's bucket was last refilled",
    "fails": "consecutive transient failures (the circuit breaker)",
    "probing": "1: the circuit is open, one call at a time",
    "backoff": "ms of the circuit's last pause",
    # Limits that learn (limits.lua, shown.lua, signals.lua): 0 in any of these means nothing learned.
    "ltpm": "learned TPM below the quota's, lowered by 429s (0: the quota's)",
    "lrpm": "learned RPM below the quota's or the discovered one (0: none learned)",
    "lcap": "learned concurrency cap below the quota's (0: the quota's)",
    "ptpm": "the level a 429 last lowered the TPM from: the effective TPM, or our recent rate if lower "
            "(its peak: its raises step by 1/20 of this)",
    "prpm": "the level a 429, or its first burst spent early, last lowered the RPM from (as ptpm)",
    "pcap": "the effective concurrency cap when a 429 last lowered it, or the calls a later 429 of its pause found "
            "(its peak; the quota's cap again after a changed limit header)",
    "htpm": "the provider's x-ratelimit-limit-tokens, per minute (0: never sent)",
    "hrpm": "the provider's x-ratelimit-limit-requests, per minute (0: never sent)",
    "lowered_at": "ms a 429 (or a first burst spent early) last lowered a learned limit",
    "raised_at": "ms a clean window last raised one",
    "window": "ms of clean traffic a raise needs now (0: CLEAN_MS); doubled by a raise that drew a 429",
    "first_at": "ms the first call under the quota started (0: none yet): the first bucket starts",
    "first_calls": "calls started under the quota (the first bucket's count)",
    "first_tokens": "their estimated tokens",
    "recent_at": "ms the recent count's current step started (shown.recent_step_ms; 0: no call yet)",
    "recent_first_at": "ms the first call in that step started",
    "recent_calls": "calls started in that step (the recent window's count, shown.recent_rate)",
    "recent_tokens": "their estimated tokens",
    "before_first_at": "ms the first call in the step before it started",
    "before_calls": "calls started in the step before it",
    "before_tokens": "their estimated tokens",
    "ramp_from": "slots slow start opens at first (0: RAMP_START): the calls live at a quota set, or the most just served at once",
    "ramp_at": "ms slow start counts its steps from: the first call's start under the quota (0: none yet)",
    "served": "the most calls started and live in flight at an answered call's end, seen within CLEAN_MS (learned.note_served)",
    "served_at": "ms it was last seen",
    "bound_tpm": "ms a call first waited for the effective TPM's tokens since the last raise or lowering (learned.note_bound)",
    "bound_rpm": "ms a call first waited for a request of the effective RPM since then",
    "bound_cap": "ms a call first found every slot taken, or ended on a full model, since then",
    "ctpm": "an x-ratelimit-limit-tokens far below the TPM held to, not believed until a second reply states it (0: none)",
    "crpm": "an x-ratelimit-limit-requests far below the RPM held to (or with none), not believed until stated again",
    # The window cap (window.lua): sums of the model's window list, entries of the last WINDOW_MS.
    "wtokens": "with window_cap: the tokens admitted in the window (WINDOW_MS)",
    "wcalls": "with window_cap: the calls admitted in the window (WINDOW_MS)",
}

#: Every field of a model's hash.
MODEL_FIELDS: tuple[str, ...] = QUOTA_FIELDS + tuple(STATE_FIELDS)


def with_defaults(stored: Mapping[str, int]) -> dict[str, int]:
    """A model's hash as read, with each field it lacks at 0 (as a new model's state starts):
    a hash written by the previous version (a rolling upgrade shares one Redis) lacks the
    fields added since. load_model in state.lua applies the same rule.

    >>> with_defaults({"cap": 4})["first_at"], with_defaults({"cap": 4})["slow_start"]
    (0, 0)
    """
    return {**dict.fromkeys(MODEL_FIELDS, 0), **stored}


def _lua_list(names: tuple[str, ...]) -> str:
    return "{" + ", ".join(f"'{n}'" for n in names) + "}"


#: Lua lines the script loader puts before the scripts' library (core.LIBRARY): the field lists, from this module.
LUA_PRELUDE = "\n".join(
    [
        "-- generated from balancer/admission/fields.py",
        f"local QUOTA_FIELDS = {_lua_list(QUOTA_FIELDS)}",
        f"local STATE_FIELDS = {_lua_list(tuple(STATE_FIELDS))}",
        f"local FIELDS = {_lua_list(MODEL_FIELDS)}",
        "",
    ]
)

"""The window cap: a quota with ``window_cap`` admits, in any 60 s, at most its TPM tokens and
(with an RPM) its RPM calls. Pure rules; window.lua applies the same ones to the model's window
list in Redis (``keys.window``), and the reference model to a list in memory.

The token bucket alone allows its burst on top of a minute of refill in one minute (a full
bucket, then the rate): ``TPM + burst`` in the worst 60 s. A provider that counts a fixed or
sliding 60 s window refuses that. With the cap, each admission is recorded as
``(admitted_ms, tokens)``, oldest first; one is admitted only if the entries of the last
``WINDOW_MS`` (admitted after ``now - WINDOW_MS``) and itself fit the quota's TPM (and RPM).
So for every admission at ``t``, the admissions in ``(t - WINDOW_MS, t]`` fit: any 60 s window's
last admission sees all the others in its own window, and so does any 60 s of the provider's
while calls reach it within ``HOP_MS`` of each other's hop.

Entries leave from the head once ``WINDOW_MS`` old. Refunds (a lease never started) and
settlements leave the window as it is: an admission counts with its estimate, whatever
happens to its call. The bucket and every other limit still apply on top.

>>> q = Quota("m", 4, 1_000, max_requests_per_minute=3, window_cap=True)
>>> entries = [(0, 600), (10_000, 300)]
>>> fits(q, entries, 100), fits(q, entries, 101), fits(q, [*entries, (20_000, 1)], 1)
(True, False, False)
>>> wait_ms(q, entries, 200, 20_000)   # the first entry leaves at 62,000 ms
42000
>>> expired_count(entries, 62_000), expired_count(entries, 61_999)
(1, 0)
"""

from __future__ import annotations

from collections.abc import Sequence

from balancer.admission.quota import Quota

#: How much later than another a call admitted with it may reach the provider (broker, worker):
#: a run's first calls started up to 2.1 s after their admissions, the next minute's within 0.4 s,
#: so the provider's minute from the first held 23 calls of a 15-call cap (8,763 tokens of a 6,000
#: TPM) while no 60 s of admissions held more than 15.
HOP_MS = 2_000
#: The window a cap counts over, ms: a minute, and the hop, so calls admitted a minute apart reach
#: the provider more than a minute apart. Over a long run a capped model carries 60/62 of its TPM.
WINDOW_MS = 60_000 + HOP_MS


def entry_text(at: int, est: int) -> str:
    """An entry as the window list in Redis holds it."""
    return f"{at}:{est}"


def sums(entries: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The tokens and calls in a window (the model hash's ``wtokens``, ``wcalls``)."""
    return sum(est for _, est in entries), len(entries)


def _fits(quota: Quota, tokens: int, calls: int, est: int) -> bool:
    rpm = quota.max_requests_per_minute or 0
    return not quota.window_cap or (tokens + est <= quota.max_tokens_per_minute and (rpm == 0 or calls + 1 <= rpm))


def fits(quota: Quota, entries: Sequence[tuple[int, int]], est: int) -> bool:
    """Whether one more admission of ``est`` tokens fits the window (always, without a cap)."""
    return _fits(quota, *sums(entries), est)


def tokens_short(quota: Quota, entries: Sequence[tuple[int, int]], est: int) -> bool:
    """The window lacks the tokens for ``est`` (its calls aside): admit's rule that holds a
    model for the large task waiting on it applies to these tokens as to the bucket's."""
    return quota.window_cap and sums(entries)[0] + est > quota.max_tokens_per_minute


def expired_count(entries: Sequence[tuple[int, int]], now: int) -> int:
    """How many entries leave the head of the window at ``now``: those admitted at or before
    ``now - WINDOW_MS``, up to the first one that is not."""
    n = 0
    for at, _ in entries:
        if at > now - WINDOW_MS:
            break
        n += 1
    return n


def wait_ms(quota: Quota, entries: Sequence[tuple[int, int]], est: int, now: int) -> int:
    """ms until the window has room for ``est``: entries leave from the head, the k-th once the
    latest of the first k is ``WINDOW_MS`` old. 0 when it fits now."""
    tokens, calls = sums(entries)
    if _fits(quota, tokens, calls, est):
        return 0
    latest = now - WINDOW_MS
    for at, tok in entries:
        tokens, calls, latest = tokens - tok, calls - 1, max(latest, at)
        if _fits(quota, tokens, calls, est):
            return max(0, latest + WINDOW_MS - now)
    return 0  # unreachable: an estimate above the TPM never fits the burst (Quota.__post_init__)


#: Lua lines the script loader puts before the scripts' library (core.LIBRARY).
LUA_PRELUDE = "\n".join(["-- generated from balancer/admission/window.py", f"local WINDOW_MS = {WINDOW_MS}", ""])

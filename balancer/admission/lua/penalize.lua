-- penalize.lua: a 429 pauses its model for Retry-After, once per window, and
-- lowers its buckets to what the provider says is left.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] model
-- ARGV[3] Retry-After in ms
-- ARGV[4] x-ratelimit-remaining-tokens, or '' if absent
-- ARGV[5] x-ratelimit-remaining-requests, or '' if absent
-- ARGV[6] x-ratelimit-limit-tokens, ARGV[7] x-ratelimit-limit-requests ('' if absent)
-- ARGV[8] the refused call's admission id, or '' (refused_at in signals.lua)
-- The pause holds the model whatever limit the provider applied (tokens,
-- requests or concurrency): admit and renew take nothing from it until it
-- ends. A 429 that arrives while the model is already paused adds no pause,
-- so N concurrent 429s pause it once, not N times as long. The header sync
-- applies to every 429: a 429 is the surest sign that someone else is using
-- the quota, and without it the bucket would still be too full after the pause.
-- A 429 that starts a pause also lowers the effective limit of the kind that
-- caused it (limit_kind, learn_from_429 in signals.lua), so that once per window
-- too; any other 429 for concurrency caps it at the started calls in flight
-- less one (those started by the refused call's start, with ARGV[8]), and its peak at them, and one for tokens or requests with no remaining count empties
-- that bucket (empty_after_429). While the pause runs, calls admitted before it that have not
-- started yet do not start (renew.lua).
-- The limit headers are synced first (sync_limits), as confirmed: a 429 carries them.
-- Returns 1 if this call started a pause, 0 if one was running (or no model).

local m = load_model(ARGV[2])
if not m then return 0 end
count(ARGV[2], 'rate_limited', 1)  -- every 429, paused or not (metrics)
local now = clock(ARGV[1])
refill(m, now)
local started = 0  -- (sync_to_headers refills the token gate's bucket itself)
sync_limits(m, ARGV[6] or '', ARGV[7] or '', true)
if m.paused <= now then
  m.paused = now + tonumber(ARGV[3])
  started = 1
end
if m.learn == 1 then
  local kind, sent = limit_kind(m, now, ARGV[4], ARGV[5], refused_at(ARGV[8] or '', ARGV[2]))
  learn_from_429(m, now, kind, sent, started == 1)
  empty_after_429(m, now, kind, ARGV[4], ARGV[5])
end
sync_to_headers(m, now, ARGV[4], ARGV[5])
save_model(m)
return started

-- finish.lua: everything a finished call tells the core, in one round trip:
-- settle its tokens, sync the buckets to the provider's headers, and free its
-- slot.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] admission id
-- ARGV[3] tokens used (prompt + completion), or '' if unknown (no usage, or no answer)
-- ARGV[4] tokens a `reserve` provider kept (prompt + max_tokens), or ''
-- ARGV[5] x-ratelimit-remaining-tokens, or '' if absent
-- ARGV[6] x-ratelimit-remaining-requests, or '' if absent
-- ARGV[7] the call's latency bucket (balancer.estimates.latency.bucket_of), or '' if no answer
-- ARGV[8] its latency in ms, ARGV[9] prompt tokens, ARGV[10] completion tokens (with ARGV[7])
-- ARGV[11] lease ms for a next call from the model's ready list, or '' to take none
-- ARGV[12] x-ratelimit-limit-tokens, ARGV[13] x-ratelimit-limit-requests ('' if absent: sync_limits in signals.lua)
-- Settling: the provider's charge is the usage (settle) or the reservation
-- (reserve). A charge above the estimate is always debited. A charge below it
-- is credited only by a `settle` model, and only within the quota generation
-- that charged it; a `reserve` model keeps it, as the provider does. No charge
-- exceeds the quota's token bucket (or the estimate, if larger): a call larger
-- than that could not have been admitted, and one reply's usage of 3e9 tokens
-- would otherwise hold the model for hours.
-- Header sync: see sync_to_headers in signals.lua (lowers, never raises, and
-- learns the rate others use of the quota), and learn_from_spent (an RPM far
-- above the provider's, seen before its first 429).
-- Latency: an answered call adds its latency and tokens to the model's sketch,
-- and to its counters (solved, latency bucket, tokens: see count in state.lua).
-- Circuit: an answered call closes its model's circuit (see trip.lua).
-- Served: an answered call notes how many calls the provider served at once (note_served in signals.lua).
-- Bound: a call that ends on a full model notes that its cap binds (note_bound in limits.lua).
-- Next call: with ARGV[11], a freed slot takes the head of its model's ready
-- list if the model can admit it now (see take_ready in ready.lua), leased as
-- started, through both start gates: the caller calls it next, no renew.
-- Returns {settled, released}: 1 if the tokens were settled now (0: unknown
-- lease, or no usage); 1 if a slot was freed (0: unknown or already
-- released). Finishing is idempotent: a second finish finds no lease. A taken next call adds six
-- values: model, task id, admission id, estimated tokens, ms to wait before
-- calling, and 1 if the list now holds fewer entries than the model has slots
-- (0 if not): only then does the caller ask the dispatcher to restock it.

local lid = ARGV[2]
local raw = redis.call('HGET', LEASES, lid)
if not raw then return {0, 0} end
local lease = cjson.decode(raw)
local settled, released = 0, 0
local m = load_model(lease.m)
local now = clock(ARGV[1])
-- The call ended on a full model: its cap bound (note_bound), and its slot's refill gap starts (mark_freed).
local full = false
if m then
  refill(m, now)
  refill_started(m, now)
  if ARGV[3] ~= '' then
    local charged = tonumber(ARGV[3])
    if m.settle == 0 then charged = tonumber(ARGV[4]) or lease.e end
    charged = math.min(charged, math.max(lease.e, m.burst))  -- at most a bucket (most_charged in values.py)
    local surplus = lease.e - charged
    if surplus < 0 or (m.settle == 1 and same_generation(m, lease)) then
      m.tokens = math.min(token_cap(m), m.tokens + surplus * UNITS)
      m.ptokens = math.min(token_cap(m), m.ptokens + surplus * UNITS)
    end
    settled = 1
  end
  sync_limits(m, ARGV[12] or '', ARGV[13] or '', false)
  local left, unstarted, counted_at = sync_to_headers(m, now, ARGV[5], ARGV[6], lid)
  learn_from_spent(m, now, left, unstarted, counted_at)
  if ARGV[7] ~= '' then
    m.fails, m.probing, m.backoff = 0, 0, 0
    redis.call('HSET', META, 'bfails', 0)  -- the backend answers: a failure is a task's again (trip.lua)
    note_served(m, now)  -- (its own lease still counted)
  end
  full = redis.call('ZSCORE', inflight_key(lease.m), lid) and redis.call('ZCARD', inflight_key(lease.m)) >= eff_cap(m)
  if full then note_bound(m, now, false, true, true) end
  save_model(m)
  if ARGV[7] ~= '' then
    record_latency(lease.m, tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]))
    count(lease.m, 'solved', 1)
    count(lease.m, 'lat' .. ARGV[7], 1)
    count(lease.m, 'latency_ms', tonumber(ARGV[8]))
    count(lease.m, 'tokens_estimated', lease.e)
    if ARGV[3] ~= '' then count(lease.m, 'tokens_used', tonumber(ARGV[3])) end
  end
end
if full then mark_freed(lease.m, now) end  -- (metrics only)
redis.call('ZREM', inflight_key(lease.m), lid)
redis.call('HDEL', LEASES, lid)
released = 1
if m and ARGV[11] ~= '' then
  purge(m, now)
  local taken, dropped = {}, {}
  take_ready(m, now, tonumber(ARGV[11]), 1, 1, false, taken, dropped)
  local nxt = taken[1]
  if nxt then
    local delay = start_delay(m, nxt.e, true, now)
    set_call_at(m, nxt.lid, now + delay, true)
    measure_refill(m.name, now)
    count(m.name, 'ready_taken', 1)
    count_system('admitted', 1)  -- an admission too, outside admit.lua
    save_model(m)
    local restock = redis.call('LLEN', ready_key(m.name)) < eff_cap(m) and 1 or 0
    return {settled, released, m.name, nxt.task, nxt.lid, fmt(nxt.e), fmt(delay), restock}
  end
  save_model(m)
end
return {settled, released}

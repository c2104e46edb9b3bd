-- renew.lua: re-assert a slot when a worker starts (or restarts) a call.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] lease length in ms
-- ARGV[3] admission id
-- ARGV[4] model
-- ARGV[5] estimated tokens
-- Returns {'NOSTATE'}, or one decision as in admit.lua. If the model was
-- disabled since admission, the lease is dropped (refunded if never started)
-- and the answer is 'W' with no time: the call must not start. A live lease is
-- extended and marked started. An expired one is re-acquired on the same model
-- (slot, tokens, request, outside WDRR) if there is room, else 'W': the caller
-- must not call the backend. An 'A' answer carries a fourth value: ms to wait
-- before calling, from the start gate (see start_gate in limits.lua). A model
-- that learns and is paused by a 429 starts no call admitted before the pause:
-- a lease not started yet is dropped and refunded, and the answer is 'W' at
-- the pause's end (the circuit breaker's pause leaves its calls alone).
-- A cap lowered since admission: a live lease starts its call only while the
-- model's live leases, itself included, are within its concurrency cap
-- (eff_cap); calls already running are not recalled, but no new one starts
-- above the new cap. Otherwise the lease is dropped (refunded if never
-- started) and the answer is 'W' at the model's next room.

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local lease_ms, lid, model, est = tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
local m = load_model(model)
if not m then return {'R', 'unknown', ''} end
refill(m, now)
purge(m, now)
local raw = redis.call('HGET', LEASES, lid)
if raw and m.enabled ~= 1 then
  -- Disabled since admission: this call must not start.
  local lease = cjson.decode(raw)
  redis.call('ZREM', inflight_key(lease.m), lid)
  redis.call('HDEL', LEASES, lid)
  if lease.s == 0 then refund(m, lease, now) end
  save_model(m)
  return {'W', '', fmt(now)}
end
if raw and m.learn == 1 and m.paused > now and m.probing ~= 1 and cjson.decode(raw).s == 0 then
  -- Admitted before a 429's pause and not started: the provider refuses it
  -- now, and the limits it was admitted under were too high. Given back.
  local lease = cjson.decode(raw)
  redis.call('ZREM', inflight_key(lease.m), lid)
  redis.call('HDEL', LEASES, lid)
  refund(m, lease, now)
  save_model(m)
  return {'W', fmt(m.paused), fmt(now)}
end
if raw then
  local lease = cjson.decode(raw)
  if redis.call('ZCARD', inflight_key(lease.m)) > eff_cap(m) then
    redis.call('ZREM', inflight_key(lease.m), lid)
    redis.call('HDEL', LEASES, lid)
    if lease.s == 0 then refund(m, lease, now) end
    local result = {'W', fmt(now + wait_ms(m, lease.e, now)), fmt(now)}
    save_model(m)
    return result
  end
  redis.call('ZADD', inflight_key(lease.m), fmt(now + lease_ms), lid)
  local first = lease.s == 0
  local delay = start_delay(m, lease.e, first, now)
  set_call_at(m, lid, now + delay, first, lease)
  save_model(m)
  return {'A', lease.m, lid, fmt(delay)}
end
local result
if est > m.burst then
  result = {'R', 'toolarge', fmt(m.burst)}
elseif m.enabled ~= 1 then
  result = {'W', '', fmt(now)}
elseif not has_capacity(m, est, now) then
  result = {'W', fmt(now + wait_ms(m, est, now)), fmt(now)}
else
  charge(m, est, now)
  put_lease(lid, m, est, now + lease_ms, 1)
  local delay = start_delay(m, est, true, now)
  set_call_at(m, lid, now + delay, true)
  result = {'A', model, lid, fmt(delay)}
end
save_model(m)
return result

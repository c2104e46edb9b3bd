-- set_quota.lua: create or change one model's live quota. Applies to the next admission.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2..10] name, weight, max_concurrent_requests, tpm, rpm (0 = none), burst, enabled (1/0),
--             settle (1: settle to actual usage, 0: reserve), request burst (0 without rpm)
-- ARGV[11] the latency prior's median in ms (0: the global default)
-- Returns {'NOSTATE'} if the live state is missing, else {'OK'}.
-- A new model starts with full buckets (the initial burst). A changed one is
-- refilled at its old rates up to now, then its buckets and deficit are
-- clipped to the new capacities, and a change of rate or size starts a new
-- quota generation so that in-flight calls charged under the old quota do not
-- credit the new bucket when they finish. A running 429 pause is kept, and so
-- is the circuit breaker's state.

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local name = ARGV[2]
local m = load_model(name)
local weight, cap, tpm, rpm, burst, enabled, settle, rburst =
  tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]),
  tonumber(ARGV[9]), tonumber(ARGV[10])
local created = not m
if created then
  m = {name = name, refilled_at = now, deficit = 0, gen = 0, paused = 0, tat = 0, ext = 0, synced_at = 0,
       prefilled_at = now, fails = 0, probing = 0, backoff = 0}
  redis.call('ZADD', MODELS, 0, name)
else
  refill(m, now)  -- at the old rates, up to now
  refill_started(m, now)
  -- A new rate or bucket size starts a new generation: credits for calls
  -- charged under the old quota are forfeited (see same_generation in lib.lua).
  if tpm ~= m.tpm or rpm ~= m.rpm or burst ~= m.burst or rburst ~= m.rburst then m.gen = m.gen + 1 end
end
local had_rpm = (not created) and m.rpm > 0
m.weight, m.cap, m.tpm, m.rpm, m.burst, m.enabled, m.settle, m.rburst =
  weight, cap, tpm, rpm, burst, enabled, settle, rburst
if created then m.tokens, m.ptokens = token_cap(m), token_cap(m) else
  m.tokens, m.ptokens = math.min(m.tokens, token_cap(m)), math.min(m.ptokens, token_cap(m))
end
if had_rpm then m.requests = math.min(m.requests, rburst * UNITS) else m.requests = rburst * UNITS end
m.deficit = math.min(m.deficit, burst)
m.ext = math.min(m.ext, math.floor(tpm * 9 / 10))
m.prior = tonumber(ARGV[11])
save_model(m)
return {'OK'}

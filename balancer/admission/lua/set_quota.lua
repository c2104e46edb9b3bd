-- set_quota.lua: create or change one model's live quota. Applies to the next admission.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2..8] name, weight, max_concurrent_requests, tpm, rpm (0 = none), burst, enabled (1/0)
-- Returns {'NOSTATE'} if the live state is missing, else {'OK'}.
-- A new model starts with full buckets (the initial burst). A changed one is
-- refilled at its old rates up to now, then its buckets and deficit are
-- clipped to the new capacities, and a change of rate or size starts a new
-- quota generation so that in-flight calls charged under the old quota do not
-- credit the new bucket when they finish.

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local name = ARGV[2]
local m = load_model(name)
local weight, cap, tpm, rpm, burst, enabled =
  tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if not m then
  m = {name = name, tokens = burst * UNITS, requests = rpm * UNITS, refilled_at = now, deficit = 0, gen = 0}
  redis.call('ZADD', MODELS, 0, name)
else
  refill(m, now)
  local had_rpm = m.rpm > 0
  m.tokens = math.min(m.tokens, burst * UNITS)
  if had_rpm then m.requests = math.min(m.requests, rpm * UNITS) else m.requests = rpm * UNITS end
  m.deficit = math.min(m.deficit, burst)
  -- A new rate or bucket size starts a new generation: credits for calls
  -- charged under the old quota are forfeited (see same_generation in lib.lua).
  if tpm ~= m.tpm or rpm ~= m.rpm or burst ~= m.burst then m.gen = m.gen + 1 end
end
m.weight, m.cap, m.tpm, m.rpm, m.burst, m.enabled = weight, cap, tpm, rpm, burst, enabled
save_model(m)
return {'OK'}

-- set_quota.lua: create or change one model's live quota. Applies to the next admission.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] name, ARGV[3..] QUOTA_FIELDS (balancer/admission/fields.py, in that order)
-- Returns {'NOSTATE'} if the live state is missing, else {'OK'}.
-- A new model starts with full buckets (the initial burst). A changed one is
-- refilled at its old rates up to now, then its buckets and deficit are
-- clipped to the new capacities, and a change of rate or size starts a new
-- quota generation so that in-flight calls charged under the old quota do not
-- credit the new bucket when they finish. A running 429 pause is kept, and so
-- is the circuit breaker's state. What 429s taught (learned limits, their
-- steps and window) is forgotten: the new quota starts clean, with a first
-- bucket and recent count of its own (first_*, recent_*, before_*) and, created or
-- changed, a slow start from the calls in flight (ramp_quota in limits.lua). So are
-- the provider's limit headers (htpm, hrpm, and any not yet believed): the
-- operator's quota is what holds until the next replies state them again (one
-- reply's `x-ratelimit-limit-tokens: 1` was otherwise cleared only by --no-learn),
-- and so is any debt: buckets below 0 start at 0, the start gate at now. How
-- many calls the provider lately served at once (served, served_at) is kept. What others
-- use (ext) is learned again, from a new baseline (synced_at = 0: the clipped
-- buckets are no one's use): kept, an estimate from a larger quota, cut to 9/10
-- of a smaller one, left it a tenth of its TPM. A window cap kept keeps its window (a
-- lower TPM waits for it to empty); one set on starts with an empty window (window.lua).

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local name = ARGV[2]
local m = load_model(name)
local q = quota_from_argv(3)
local created = not m
if created then
  m = new_model(name, q, now)
  m.tokens, m.ptokens, m.requests = token_cap(m), token_cap(m), q.rburst * UNITS
  window_clear(m)
  redis.call('ZADD', MODELS, 0, name)
else
  refill(m, now)  -- at the old rates, up to now
  refill_started(m, now)
  -- A new rate or bucket size starts a new generation: credits for calls
  -- charged under the old quota are forfeited (see same_generation in limits.lua).
  if q.tpm ~= m.tpm or q.rpm ~= m.rpm or q.burst ~= m.burst or q.rburst ~= m.rburst then m.gen = m.gen + 1 end
  local had_rpm = eff_rpm(m) > 0
  for _, f in ipairs(QUOTA_FIELDS) do m[f] = q[f] end
  m.ltpm, m.lrpm, m.lcap, m.ptpm, m.prpm, m.pcap = 0, 0, 0, 0, 0, 0
  m.lowered_at, m.raised_at, m.window = 0, 0, 0
  m.first_at, m.first_calls, m.first_tokens = 0, 0, 0
  m.recent_at, m.recent_first_at, m.recent_calls, m.recent_tokens = 0, 0, 0, 0
  m.before_first_at, m.before_calls, m.before_tokens = 0, 0, 0
  m.tokens, m.ptokens = math.min(m.tokens, token_cap(m)), math.min(m.ptokens, token_cap(m))
  if had_rpm then m.requests = math.min(m.requests, eff_rburst(m) * UNITS) else m.requests = eff_rburst(m) * UNITS end
  m.deficit = math.min(m.deficit, m.burst)
  m.ext, m.synced_at = 0, 0  -- learned again; the clipped buckets are no one's use
  m.htpm, m.hrpm, m.ctpm, m.crpm = 0, 0, 0, 0  -- the limit headers too: the next replies state them again
  -- No debt: a bucket below 0 (an overdraft, a hostile usage) starts the new quota at 0.
  m.tokens, m.ptokens, m.requests = math.max(m.tokens, 0), math.max(m.ptokens, 0), math.max(m.requests, 0)
  m.tat = math.min(m.tat, now)  -- nor a start gate booked ahead
  if m.window_cap ~= 1 then window_clear(m) end  -- a cap kept keeps its window
end
ramp_quota(m, now)  -- a slow start from the calls in flight (a recreated model's too)
save_model(m)
return {'OK'}

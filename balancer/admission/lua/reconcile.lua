-- reconcile.lua: after a call, debit (or credit) actual - estimated tokens, once per lease.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] admission id
-- ARGV[3] actual tokens used (prompt + completion)
-- A surplus (estimate above actual) is credited only within the quota
-- generation that charged it; an overrun is always debited.
-- Returns 1 if applied, 0 if the lease is unknown or was already reconciled.

local raw = redis.call('HGET', LEASES, ARGV[2])
if not raw then return 0 end
local lease = cjson.decode(raw)
if lease.r == 1 then return 0 end
local m = load_model(lease.m)
if not m then return 0 end
refill(m, clock(ARGV[1]))
local surplus = lease.e - tonumber(ARGV[3])
if surplus < 0 or same_generation(m, lease) then
  m.tokens = math.min(m.burst * UNITS, m.tokens + surplus * UNITS)
end
save_model(m)
lease.r = 1
redis.call('HSET', LEASES, ARGV[2], cjson.encode(lease))
return 1

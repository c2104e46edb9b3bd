-- heartbeat.lua: a caller that is still at work keeps its slot for another lease.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] admission id
-- ARGV[3] the new lease, in ms from now
-- Only a live lease is extended: one that expired is gone for good (its slot
-- may already carry another call), so the caller hears "not found" and no
-- slot is re-acquired behind the quota's back. Nothing is settled or charged.
-- Returns 1 if the lease now ends at now + ARGV[3], 0 if it was unknown or expired.

local lid = ARGV[2]
local raw = redis.call('HGET', LEASES, lid)
if not raw then return 0 end
local lease = cjson.decode(raw)
local key = inflight_key(lease.m)
local deadline = tonumber(redis.call('ZSCORE', key, lid))
local now = clock(ARGV[1])
if not deadline or deadline <= now then return 0 end
redis.call('ZADD', key, fmt(now + tonumber(ARGV[3])), lid)
return 1

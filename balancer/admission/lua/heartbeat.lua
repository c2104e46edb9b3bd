-- heartbeat.lua: a caller that is still at work keeps its slot for another lease.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] admission id
-- ARGV[3] the new lease, in ms from now
-- Only a live lease is extended: one that expired is gone for good (its slot
-- may already carry another call), so the caller hears "not found" and no
-- slot is re-acquired behind the quota's back. Nothing is settled or charged.
-- Returns 1 if the lease now ends at now + ARGV[3], 0 if it was unknown or expired.

local lid, now = ARGV[2], clock(ARGV[1])
local key = live_lease(lid, now)
if not key then return 0 end
redis.call('ZADD', key, fmt(now + tonumber(ARGV[3])), lid)
return 1

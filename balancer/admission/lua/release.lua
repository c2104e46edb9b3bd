-- release.lua: free a slot at once when a call completes. Idempotent.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] admission id
-- Returns 1 if a lease was released, 0 if it was unknown (already released or expired).

local raw = redis.call('HGET', LEASES, ARGV[1])
if not raw then return 0 end
local lease = cjson.decode(raw)
redis.call('ZREM', inflight_key(lease.m), ARGV[1])
redis.call('HDEL', LEASES, ARGV[1])
return 1

-- hold.lua: keep a cancelled call's slot until the provider would have ended the call.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] admission id
-- ARGV[3] how much longer to hold the slot, in ms from now
-- A provider that keeps working on a non-streamed request after the client
-- disconnects keeps its slot busy and charges it in full. So the lease stays,
-- unsettled (its reservation stays charged), and its deadline becomes
-- now + ARGV[3], never later than it was; the next purge frees the slot.
-- Returns 1 if a live lease is now held, 0 if the lease was unknown or expired.

local lid = ARGV[2]
local raw = redis.call('HGET', LEASES, lid)
if not raw then return 0 end
local lease = cjson.decode(raw)
local key = inflight_key(lease.m)
local deadline = tonumber(redis.call('ZSCORE', key, lid))
local now = clock(ARGV[1])
if not deadline or deadline <= now then return 0 end
redis.call('ZADD', key, fmt(math.min(deadline, now + tonumber(ARGV[3]))), lid)
return 1

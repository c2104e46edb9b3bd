-- hold.lua: keep a cancelled call's slot until the provider would have ended the call.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] admission id
-- ARGV[3] how much longer to hold the slot, in ms from now
-- A provider that keeps working on a non-streamed request after the client
-- disconnects keeps its slot busy and charges it in full. So the lease stays,
-- unsettled (its reservation stays charged), and its deadline becomes
-- now + ARGV[3], never later than it was; the next purge frees the slot.
-- Returns 1 if a live lease is now held, 0 if the lease was unknown or expired.

local lid, now = ARGV[2], clock(ARGV[1])
local key, deadline = live_lease(lid, now)
if not key then return 0 end
redis.call('ZADD', key, fmt(math.min(deadline, now + tonumber(ARGV[3]))), lid)
return 1

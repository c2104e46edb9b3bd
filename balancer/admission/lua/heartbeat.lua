-- heartbeat.lua: a caller that is still at work keeps its slot for another lease.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] admission id
-- ARGV[3] the new lease, in ms from now
-- ARGV[4] '1' if the caller is about to start its call on this lease (a call
--         taken from a ready list whose start waited), else '' or absent
-- Only a live lease is extended: one that expired is gone for good (its slot
-- may already carry another call), so the caller hears "not found" and no
-- slot is re-acquired behind the quota's back. Nothing is settled or charged.
-- A call about to start keeps its lease only while its model exists and the
-- model's live leases, itself included, are within its concurrency cap
-- (eff_cap, as stored): a cap lowered since the lease was taken lets no new
-- call start above it. Otherwise the lease is dropped (nothing refunded: it
-- was charged as started) and the caller hears 0.
-- Returns 1 if the lease now ends at now + ARGV[3], 0 if it was unknown or expired (or dropped).

local lid, now = ARGV[2], clock(ARGV[1])
local key = live_lease(lid, now)
if not key then return 0 end
if ARGV[4] == '1' then
  local m = load_model(cjson.decode(redis.call('HGET', LEASES, lid)).m)
  if not m or redis.call('ZCOUNT', key, '(' .. fmt(now), '+inf') > eff_cap(m) then
    redis.call('ZREM', key, lid)
    redis.call('HDEL', LEASES, lid)
    return 0
  end
end
redis.call('ZADD', key, fmt(now + tonumber(ARGV[3])), lid)
return 1

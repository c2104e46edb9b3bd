-- remove_quota.lua: delete one model, its live leases and its latency sketch.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] model name
-- Returns {'NOSTATE'} if the live state is missing, else {'OK', 1 or 0 (did it exist)}.

if not loaded() then return {'NOSTATE'} end
local name = ARGV[1]
if not redis.call('ZSCORE', MODELS, name) then return {'OK', 0} end
local key = inflight_key(name)
for _, lid in ipairs(redis.call('ZRANGE', key, 0, -1)) do redis.call('HDEL', LEASES, lid) end
redis.call('DEL', key, model_key(name), latency_key(name))
redis.call('ZREM', MODELS, name)
return {'OK', 1}

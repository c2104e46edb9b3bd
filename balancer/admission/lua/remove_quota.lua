-- remove_quota.lua: delete one model, its latency sketch, its window and its ready list
-- (those tasks return to pending at their database deadline). Its live leases stay:
-- their calls are still running at the provider, and if the model is created
-- again they still count against its cap. Each is freed by its call's finish,
-- as usual, or purged at its deadline once the model exists again.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] model name
-- Returns {'NOSTATE'} if the live state is missing, else {'OK', 1 or 0 (did it exist)}.

if not loaded() then return {'NOSTATE'} end
local name = ARGV[1]
if not redis.call('ZSCORE', MODELS, name) then return {'OK', 0} end
redis.call('DEL', model_key(name), latency_key(name), ready_key(name), window_key(name))
redis.call('ZREM', MODELS, name)
return {'OK', 1}

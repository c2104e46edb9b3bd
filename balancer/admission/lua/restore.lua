-- restore.lua: rebuild the live state after Redis lost it, from PostgreSQL's copy.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] number of quotas Q, then Q groups: the name, then QUOTA_FIELDS
--         (balancer/admission/fields.py, in that order)
-- then the number of in-flight leases L, then L groups of 4:
--         admission id, model, estimated tokens, lease ms left (placed on this clock: now + ms left)
-- Returns 1 if it restored, 0 if the state was already there (another process won).
-- Buckets start empty, not full: the provider may have just seen a burst.
-- Leases are re-seeded as started, so the calls still running count against the caps,
-- and each model's slow start opens from them.
-- Ready lists start empty: their tasks go back to pending at their database deadline.

if loaded() then return 0 end
local now = clock(ARGV[1])
for _, name in ipairs(redis.call('ZRANGE', MODELS, 0, -1)) do
  redis.call('DEL', model_key(name), inflight_key(name), latency_key(name), ready_key(name), window_key(name))
end
redis.call('DEL', MODELS, LEASES)
redis.call('HSET', META, 'loaded', '1', 'epoch', fmt(now), 'seq', '0', 'rr', '')
local q = tonumber(ARGV[2])
local i = 3
for _ = 1, q do
  local m = new_model(ARGV[i], quota_from_argv(i + 1), now)  -- its buckets empty
  window_clear(m)  -- and its window (the admissions before the loss are not known)
  save_model(m)
  redis.call('ZADD', MODELS, 0, m.name)
  i = i + 1 + #QUOTA_FIELDS
end
local l = tonumber(ARGV[i])
i = i + 1
for _ = 1, l do
  if redis.call('ZSCORE', MODELS, ARGV[i + 1]) then
    put_lease(ARGV[i], {name = ARGV[i + 1], gen = 0}, tonumber(ARGV[i + 2]), now + tonumber(ARGV[i + 3]), 1)
  end
  i = i + 4
end
-- Slow start opens from the calls still running, not from RAMP_START (ramp_cap in limits.lua).
for _, name in ipairs(redis.call('ZRANGE', MODELS, 0, -1)) do
  local m = load_model(name)
  ramp_quota(m, now)
  save_model(m)
end
return 1

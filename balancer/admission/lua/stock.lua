-- stock.lua: put tasks on models' ready lists (see take_ready in ready.lua), in
-- the order given. The caller names each entry's admission id and has already
-- marked its task queued under it in PostgreSQL (and committed), so whoever
-- takes the entry finds the task ready to start.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] how long an entry may wait to be taken, ms
-- ARGV[3] number of entries N, then N groups of 4: model, task id, estimated tokens, admission id
-- Returns {'NOSTATE'} if the live state is missing, else one number per entry:
-- 1 stocked, 0 not (the model is unknown).

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local ttl, n = tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 0, n - 1 do
  local name, task, est, lid = ARGV[4 + 4 * i], ARGV[5 + 4 * i], ARGV[6 + 4 * i], ARGV[7 + 4 * i]
  if redis.call('ZSCORE', MODELS, name) then
    redis.call('RPUSH', ready_key(name), task .. ':' .. lid .. ':' .. est .. ':' .. fmt(now + ttl))
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out

-- stock.lua: put tasks on models' ready lists (see take_ready in lib.lua), each
-- under a new admission id, in the order given.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see lib.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] how long an entry may wait to be taken, ms
-- ARGV[3] number of entries N, then N triples: model, task id, estimated tokens
-- Returns {'NOSTATE'} if the live state is missing, else one string per entry:
-- its admission id, or '' if the model is unknown (not stocked).

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local ttl, n = tonumber(ARGV[2]), tonumber(ARGV[3])
local meta = redis.call('HMGET', META, 'epoch', 'seq')
local epoch, seq = meta[1], tonumber(meta[2])
local out = {}
for i = 0, n - 1 do
  local name, task, est = ARGV[4 + 3 * i], ARGV[5 + 3 * i], ARGV[6 + 3 * i]
  if redis.call('ZSCORE', MODELS, name) then
    seq = seq + 1
    local lid = epoch .. '-' .. fmt(seq)
    redis.call('RPUSH', ready_key(name), task .. ':' .. lid .. ':' .. est .. ':' .. fmt(now + ttl))
    out[#out + 1] = lid
  else
    out[#out + 1] = ''
  end
end
redis.call('HSET', META, 'seq', fmt(seq))
return out

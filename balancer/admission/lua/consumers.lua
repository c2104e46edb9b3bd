-- consumers.lua: a worker process says which models' queues it consumes, until
-- now + ARGV[2] ms (its beat renews it), or that it consumes them no more.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] how long the record lives, in ms (0: the worker stops: its records go)
-- ARGV[3] the silence, in ms: a beat that comes longer than this after the last
--         one heard from any worker, or with none on record (Redis lost its data,
--         or no worker beat for a minute), notes that beats resumed (Redis was
--         away, or every worker was), in <tag>:consumers (heard, resumed): the
--         dispatcher believes lapsed records again only a record's life later
--         (balancer/admission/liveness.py)
-- ARGV[4] the consumer's id, ARGV[5..] the models' names
-- Records past their time are dropped as the key is written; the keys
-- expire a minute after their last write (a namespace whose workers are gone).
-- Needs no live state (no loaded() check): a worker beats from its start.
-- Returns the number of models named.

local now, ttl, silence, who = clock(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if ttl > 0 then
  local heard_key = PREFIX .. CONSUMERS_HEARD
  local last = tonumber(redis.call('HGET', heard_key, 'heard') or '')
  if not last or now - last > silence then redis.call('HSET', heard_key, 'resumed', fmt(now)) end
  redis.call('HSET', heard_key, 'heard', fmt(now))
  redis.call('PEXPIRE', heard_key, ttl + 60000)
end
for i = 5, #ARGV do
  local key = PREFIX .. CONSUMERS_INFIX .. ARGV[i]
  if ttl > 0 then
    redis.call('ZADD', key, fmt(now + ttl), who)
  else
    redis.call('ZREM', key, who)
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
  redis.call('PEXPIRE', key, ttl + 60000)
end
return #ARGV - 4

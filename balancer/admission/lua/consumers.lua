-- consumers.lua: a worker process says which models' queues it consumes, until
-- now + ARGV[2] ms (its beat renews it), or that it consumes them no more.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] how long the record lives, in ms (0: the worker stops: its records go)
-- ARGV[3] the consumer's id, ARGV[4..] the models' names
-- Records past their time are dropped as the key is written; the key itself
-- expires a minute after its last write (a namespace whose workers are gone).
-- Needs no live state (no loaded() check): a worker beats from its start.
-- Returns the number of models named.

local now, ttl, who = clock(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
for i = 4, #ARGV do
  local key = PREFIX .. CONSUMERS_INFIX .. ARGV[i]
  if ttl > 0 then
    redis.call('ZADD', key, fmt(now + ttl), who)
  else
    redis.call('ZREM', key, who)
  end
  redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now))
  redis.call('PEXPIRE', key, ttl + 60000)
end
return #ARGV - 3

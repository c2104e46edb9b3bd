-- lib.lua: helpers shared by every admission script. The loader prepends this
-- file to each script body (Redis Lua has no `require`), so KEYS below are the
-- calling script's KEYS.
--
-- KEYS[1]  <tag>:meta     hash   loaded, epoch, seq, rr (last model chosen)
-- KEYS[2]  <tag>:models   zset   model names, all score 0 (lexicographic order)
-- KEYS[3]  <tag>:leases   hash   admission id -> cjson {m=model, e=est, s=started, r=reconciled,
--                                 g=the model's quota generation at admission}
-- Derived from the same hash tag, so every key lands in one Cluster slot:
--   <tag>:model:<name>     hash   weight cap tpm rpm burst enabled tokens requests refilled_at deficit gen
--   <tag>:inflight:<name>  zset   admission id -> lease deadline (ms)
--
-- Units: time in integer ms; buckets in units of 1/60000 token (or request),
-- so refilling at tpm tokens/min is exactly tpm units per ms. All numbers stay
-- integers below 2^53, exact in Lua's doubles. Stored with fmt() because
-- tostring() would print 1.8e+15.

local UNITS = 60000
local META, MODELS, LEASES = KEYS[1], KEYS[2], KEYS[3]
local PREFIX = string.sub(KEYS[1], 1, -6) -- strip ':meta'

local function fmt(n) return string.format('%d', n) end
local function model_key(name) return PREFIX .. ':model:' .. name end
local function inflight_key(name) return PREFIX .. ':inflight:' .. name end

-- The clock is Redis TIME unless a test injects one.
local function clock(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function loaded() return redis.call('HGET', META, 'loaded') == '1' end

local FIELDS = {'weight', 'cap', 'tpm', 'rpm', 'burst', 'enabled',
                'tokens', 'requests', 'refilled_at', 'deficit', 'gen'}

local function load_model(name)
  local raw = redis.call('HMGET', model_key(name), unpack(FIELDS))
  if not raw[1] then return nil end
  local m = {name = name}
  for i, f in ipairs(FIELDS) do m[f] = tonumber(raw[i]) end
  m.gen = m.gen or 0
  return m
end

local function save_model(m)
  redis.call('HSET', model_key(m.name),
    'weight', fmt(m.weight), 'cap', fmt(m.cap), 'tpm', fmt(m.tpm), 'rpm', fmt(m.rpm),
    'burst', fmt(m.burst), 'enabled', fmt(m.enabled), 'tokens', fmt(m.tokens),
    'requests', fmt(m.requests), 'refilled_at', fmt(m.refilled_at), 'deficit', fmt(m.deficit),
    'gen', fmt(m.gen))
end

local function refill(m, now)
  local dt = now - m.refilled_at
  if dt < 0 then dt = 0 end
  m.tokens = math.min(m.burst * UNITS, m.tokens + dt * m.tpm)
  if m.rpm > 0 then m.requests = math.min(m.rpm * UNITS, m.requests + dt * m.rpm) end
  if now > m.refilled_at then m.refilled_at = now end
end

-- Credits (refunds, reconcile surpluses) go back only to the quota generation
-- that charged them: after a rate or burst change, tokens charged under the
-- old quota must not inflate the new, possibly much smaller, bucket.
local function same_generation(m, lease) return (lease.g or 0) == m.gen end

-- Give back what an admission charged, for a call that never happened.
local function refund(m, lease)
  if not same_generation(m, lease) then return end
  local est = lease.e
  m.tokens = math.min(m.burst * UNITS, m.tokens + est * UNITS)
  if m.rpm > 0 then m.requests = math.min(m.rpm * UNITS, m.requests + UNITS) end
end

-- Drop expired leases. One never started (no worker renewed it) made no call,
-- so its tokens and request go back to the buckets.
local function purge(m, now)
  local key = inflight_key(m.name)
  local expired = redis.call('ZRANGEBYSCORE', key, '-inf', fmt(now))
  for _, lid in ipairs(expired) do
    local raw = redis.call('HGET', LEASES, lid)
    if raw then
      local lease = cjson.decode(raw)
      if lease.s == 0 then refund(m, lease) end
      redis.call('HDEL', LEASES, lid)
    end
  end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now)) end
end

local function has_capacity(m, est)
  return redis.call('ZCARD', inflight_key(m.name)) < m.cap
     and m.tokens >= est * UNITS
     and (m.rpm == 0 or m.requests >= UNITS)
end

-- ms until m has a slot, the tokens and a request for est.
local function wait_ms(m, est, now)
  local w = 0
  if m.tokens < est * UNITS then w = math.ceil((est * UNITS - m.tokens) / m.tpm) end
  if m.rpm > 0 and m.requests < UNITS then
    w = math.max(w, math.ceil((UNITS - m.requests) / m.rpm))
  end
  local key = inflight_key(m.name)
  local n = redis.call('ZCARD', key)
  if n >= m.cap then
    local r = redis.call('ZRANGE', key, n - m.cap, n - m.cap, 'WITHSCORES')
    w = math.max(w, tonumber(r[2]) - now)
  end
  return w
end

local function charge(m, est)
  m.tokens = m.tokens - est * UNITS
  if m.rpm > 0 then m.requests = m.requests - UNITS end
end

local function put_lease(lid, m, est, deadline, started)
  redis.call('ZADD', inflight_key(m.name), fmt(deadline), lid)
  redis.call('HSET', LEASES, lid, cjson.encode({m = m.name, e = est, s = started, r = 0, g = m.gen}))
end
-- end of lib.lua

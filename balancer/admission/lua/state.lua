-- state.lua: what the admission scripts keep in Redis, and how they read and
-- write it: the keys, the counters and the latency sketch (observation only),
-- the clock, leases, and a model's hash (load, save, a new one).
--
-- The script library is six files, in this order (LIBRARY in
-- balancer/admission/core.py): state.lua, window.lua (the window cap),
-- shown.lua (the provider's rate our call starts show), limits.lua (what a
-- model admits under), signals.lua (what the provider's answers teach),
-- ready.lua (ready lists). Redis Lua has no `require`: the loader prepends the six to each
-- script body as one chunk, so a local defined in one file is visible in
-- the files after it, and KEYS below are the calling script's KEYS. Before
-- them, the loader puts the key infixes (META_SUFFIX, MODEL_INFIX,
-- INFLIGHT_INFIX, ...) from balancer/admission/keys.py, the one module that
-- names keys, the model hash's field lists (QUOTA_FIELDS, STATE_FIELDS,
-- FIELDS) from balancer/admission/fields.py, the bucket units and allowances
-- (UNITS, TRANSIT_MS, GATE_HOP_MS, SYNC_LAG_MS, OUTSIDE_MARGIN_MS, OUTSIDE_TAU_MS) from
-- balancer/admission/values.py,
-- and the constants of limits that learn (CLEAN_MS, ...) from balancer/admission/learned.py.
--
-- KEYS[1]  <tag>:meta     hash   loaded, epoch, seq, rr (last model chosen)
-- KEYS[2]  <tag>:models   zset   model names, all score 0 (lexicographic order)
-- KEYS[3]  <tag>:leases   hash   admission id -> cjson {m=model, e=est, s=started,
--                                 g=the model's quota generation at admission,
--                                 a=ms its call starts, once started, c=the model's started_sum
--                                 before it: set_call_at}
-- Derived inside the scripts, not passed in KEYS: admit.lua visits every model
-- and finish learns the model from the lease, so the caller cannot
-- name these keys in advance. They share the hash tag of KEYS[1], so every key
-- a script touches lands in one Cluster slot:
--   <tag>:model:<name>     hash   the model's quota and live state: FIELDS, declared (with what
--                                 each holds) in balancer/admission/fields.py
--   <tag>:inflight:<name>  zset   admission id -> lease deadline (ms)
--   <tag>:latency:<name>   hash   the latency sketch: b<i> (decayed count of calls in bucket i),
--                                 ms, pt, ct (decayed sums of latency, prompt and completion tokens)
--   <tag>:stats:<name>     hash   counters since the start (metrics only): solved, rate_limited,
--                                 tokens_used, tokens_estimated, latency_ms, lat<i> (calls in bucket i),
--                                 the refill gap: freed_at (ms a slot of the full model freed; 0: none
--                                 waiting), gap<le> (gaps up to le ms), gap_ms (their sum), gaps,
--                                 ready_taken (next calls a finishing call took from the ready list)
--   <tag>:ready:<name>     list   the model's ready list: 'task:lid:est:expires_ms' (see take_ready below)
--   <tag>:consumers:<name> zset   consumer id -> until (ms): the worker processes consuming its queue
--   <tag>:consumers        hash   heard, resumed (ms): the last beat of any worker, and when beats
--                                 resumed after a silence (consumers.lua; balancer/admission/liveness.py)
--   <tag>:stats            hash   admitted, not_now, rejected (admission decisions), dispatch_rounds
--                                 (admit calls)
--
-- Units: time in integer ms; buckets in units of 1/60000 token (or request),
-- so refilling at tpm tokens/min is exactly tpm units per ms. All numbers stay
-- integers below 2^53, exact in Lua's doubles. Stored with fmt() because
-- tostring() would print 1.8e+15. (UNITS: the values prelude, from balancer/admission/values.py.)

local META, MODELS, LEASES = KEYS[1], KEYS[2], KEYS[3]
local PREFIX = string.sub(KEYS[1], 1, -(#META_SUFFIX + 1)) -- the hash tag

local function fmt(n) return string.format('%d', n) end
local function model_key(name) return PREFIX .. MODEL_INFIX .. name end
local function inflight_key(name) return PREFIX .. INFLIGHT_INFIX .. name end
local function latency_key(name) return PREFIX .. LATENCY_INFIX .. name end

-- Whether a worker process consumes the model's queue now: a live record in
-- <tag>:consumers:<name> (zset: consumer id -> until, ms), renewed by each
-- worker's beat (consumers.lua). The dispatcher's admissions require one.
local function consumed(name, now)
  return redis.call('ZCOUNT', PREFIX .. CONSUMERS_INFIX .. name, '(' .. fmt(now), '+inf') > 0
end

-- Counters for `balancer metrics` (<tag>:stats:<name>, <tag>:stats): observation
-- only, never read by any rule here, so the reference model does not keep them.
local function count(name, field, n) redis.call('HINCRBY', PREFIX .. STATS_INFIX .. name, field, n) end
local function count_system(field, n) if n > 0 then redis.call('HINCRBY', PREFIX .. SYSTEM_STATS, field, n) end end

-- The refill gap: how long a slot freed by a model at its cap waits for its next
-- admission (finish.lua marks the slot, admit.lua measures it). Counted into
-- cumulative-free buckets gap<le> (le in ms; 'inf' above the last edge).
local GAP_EDGES_MS = {5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000}
local function mark_freed(name, now) redis.call('HSET', PREFIX .. STATS_INFIX .. name, 'freed_at', string.format('%d', now)) end
local function measure_refill(name, now)
  local key = PREFIX .. STATS_INFIX .. name
  local freed = tonumber(redis.call('HGET', key, 'freed_at') or '0')
  if freed <= 0 then return end
  local gap = math.max(0, now - freed)
  local le = 'inf'
  for _, edge in ipairs(GAP_EDGES_MS) do
    if gap <= edge then le = string.format('%d', edge); break end
  end
  redis.call('HSET', key, 'freed_at', '0')
  redis.call('HINCRBY', key, 'gap' .. le, 1)
  redis.call('HINCRBY', key, 'gap_ms', gap)
  redis.call('HINCRBY', key, 'gaps', 1)
end

-- Add one finished call to its model's latency sketch: decay every field by
-- 1/64 (integer floor), then add the sample. The bucket index comes from the
-- caller (balancer.estimates.latency.bucket_of), so this is integer arithmetic
-- only, exactly as balancer.estimates.latency.record does it.
local SAMPLE_WEIGHT, DECAY = 1000, 64
local function record_latency(name, bucket, latency_ms, prompt_tokens, completion_tokens)
  local key = latency_key(name)
  local raw = redis.call('HGETALL', key)
  local fields = {}
  for i = 1, #raw, 2 do
    local v = tonumber(raw[i + 1])
    fields[raw[i]] = v - math.floor(v / DECAY)
  end
  local b = 'b' .. bucket
  fields[b] = (fields[b] or 0) + SAMPLE_WEIGHT
  fields.ms = (fields.ms or 0) + latency_ms
  fields.pt = (fields.pt or 0) + prompt_tokens
  fields.ct = (fields.ct or 0) + completion_tokens
  local flat = {}
  for k, v in pairs(fields) do flat[#flat + 1] = k; flat[#flat + 1] = fmt(v) end
  redis.call('HSET', key, unpack(flat))
end

-- The clock is Redis TIME unless a test injects one.
local function clock(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function loaded() return redis.call('HGET', META, 'loaded') == '1' end

-- The in-flight key and deadline of lease `lid` if it is live at `now`; nil if unknown or expired.
local function live_lease(lid, now)
  local raw = redis.call('HGET', LEASES, lid)
  if not raw then return nil end
  local key = inflight_key(cjson.decode(raw).m)
  local deadline = tonumber(redis.call('ZSCORE', key, lid))
  if not deadline or deadline <= now then return nil end
  return key, deadline
end

-- Lease `lid` on model m until `deadline` for est tokens; `started`: 1 for a
-- call that starts now or runs already (renew, restore), 0 for an admission
-- no worker has started yet (admit).
local function put_lease(lid, m, est, deadline, started)
  redis.call('ZADD', inflight_key(m.name), fmt(deadline), lid)
  redis.call('HSET', LEASES, lid, cjson.encode({m = m.name, e = est, s = started, g = m.gen}))
end

-- Lease `lid`'s call on model m starts at `at` (ms, once through its start gates):
-- marked started, with that time (`a`: see unarrived in signals.lua). At its
-- `first` start it also keeps the model's started_sum before its own tokens (`c`),
-- and adds them: the tokens of the calls started after it are then started_sum - c
-- - e. A lease started before (renewed again, or restored) keeps what it has.
-- `lease`: the lease as the caller decoded it, or nil to read it.
local function set_call_at(m, lid, at, first, lease)
  lease = lease or cjson.decode(redis.call('HGET', LEASES, lid))
  if first then
    lease.c = m.started_sum
    m.started_sum = m.started_sum + lease.e
  end
  lease.s, lease.a = 1, at
  redis.call('HSET', LEASES, lid, cjson.encode(lease))
end

-- A model's hash holds FIELDS (QUOTA_FIELDS, then STATE_FIELDS): a model is
-- created whole (new_model) and saved whole (save_model). A hash written by
-- the previous version (a rolling upgrade shares one Redis) lacks the fields
-- added since: each reads as 0, as a new model's state starts (fields.py,
-- with_defaults, is the same rule for the live view).
local function load_model(name)
  local raw = redis.call('HMGET', model_key(name), unpack(FIELDS))
  if not raw[1] then return nil end
  local m = {name = name}
  for i, f in ipairs(FIELDS) do m[f] = tonumber(raw[i]) end
  for _, f in ipairs(FIELDS) do if m[f] == nil then m[f] = 0 end end
  return m
end

local function save_model(m)
  local flat = {}
  for _, f in ipairs(FIELDS) do
    flat[#flat + 1] = f
    flat[#flat + 1] = fmt(m[f])
  end
  redis.call('HSET', model_key(m.name), unpack(flat))
end

-- The quota fields from ARGV[i], ARGV[i + 1], ... (in QUOTA_FIELDS order), as a table.
local function quota_from_argv(i)
  local q = {}
  for k, f in ipairs(QUOTA_FIELDS) do q[f] = tonumber(ARGV[i + k - 1]) end
  return q
end

-- A new model: quota q, every state field 0 but the refill clocks (at now).
-- The caller fills its buckets.
local function new_model(name, q, now)
  local m = {name = name}
  for _, f in ipairs(QUOTA_FIELDS) do m[f] = q[f] end
  for _, f in ipairs(STATE_FIELDS) do m[f] = 0 end
  m.refilled_at, m.prefilled_at = now, now
  return m
end

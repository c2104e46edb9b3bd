-- lib.lua: helpers shared by every admission script. The loader prepends this
-- file to each script body (Redis Lua has no `require`), so KEYS below are the
-- calling script's KEYS. Before it, the loader puts the key infixes
-- (META_SUFFIX, MODEL_INFIX, INFLIGHT_INFIX, ...) from balancer/admission/keys.py,
-- the one module that names keys, and the model hash's field lists
-- (QUOTA_FIELDS, STATE_FIELDS, FIELDS) from balancer/admission/fields.py.
--
-- KEYS[1]  <tag>:meta     hash   loaded, epoch, seq, rr (last model chosen)
-- KEYS[2]  <tag>:models   zset   model names, all score 0 (lexicographic order)
-- KEYS[3]  <tag>:leases   hash   admission id -> cjson {m=model, e=est, s=started,
--                                 g=the model's quota generation at admission}
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
--   <tag>:stats            hash   admitted, not_now, rejected (admission decisions), dispatch_rounds
--                                 (admit calls)
--
-- Units: time in integer ms; buckets in units of 1/60000 token (or request),
-- so refilling at tpm tokens/min is exactly tpm units per ms. All numbers stay
-- integers below 2^53, exact in Lua's doubles. Stored with fmt() because
-- tostring() would print 1.8e+15.

local UNITS = 60000
local META, MODELS, LEASES = KEYS[1], KEYS[2], KEYS[3]
local PREFIX = string.sub(KEYS[1], 1, -(#META_SUFFIX + 1)) -- the hash tag

local function fmt(n) return string.format('%d', n) end
local function model_key(name) return PREFIX .. MODEL_INFIX .. name end
local function inflight_key(name) return PREFIX .. INFLIGHT_INFIX .. name end
local function latency_key(name) return PREFIX .. LATENCY_INFIX .. name end

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

-- Limits that learn. A model's effective limits are its quota's, or lower:
-- with learn = 1, the provider's x-ratelimit-limit-* headers (htpm, hrpm) cap
-- them, and give an RPM to a quota that leaves it unset; a 429 lowers the kind
-- that caused it (ltpm, lrpm, lcap: see learn_from_429), and clean windows
-- raise it back (relax). Bucket sizes scale with their rates. Every rule below
-- reads these, never the quota's fields directly, except the burst that
-- decides whether a task can ever fit (the configured one).
-- (CLEAN_MS, MAX_WINDOW_MS, RAMP_START and RAMP_MS come from learned.py's prelude.)
local function lower_of(limit, other)  -- the lower of two limits, 0 meaning none
  if other > 0 and (limit == 0 or other < limit) then return other end
  return limit
end
local function eff_tpm(m)
  if m.learn ~= 1 then return m.tpm end
  return lower_of(lower_of(m.tpm, m.htpm), m.ltpm)
end
local function eff_rpm(m)
  if m.learn ~= 1 then return m.rpm end
  return lower_of(lower_of(m.rpm, m.hrpm), m.lrpm)
end
local function eff_cap(m)
  if m.learn ~= 1 then return m.cap end
  return lower_of(m.cap, m.lcap)
end
local function eff_burst(m)
  local t = eff_tpm(m)
  if t == m.tpm then return m.burst end
  return math.max(1, math.floor(m.burst * t / m.tpm))
end
local function eff_rburst(m)
  local r = eff_rpm(m)
  if r == m.rpm then return m.rburst end
  if m.rpm == 0 then return r end  -- discovered: one minute of it
  return math.max(1, math.floor(m.rburst * r / m.rpm))
end
-- Tokens per minute the bucket refills at: TPM less what others use (never below a tenth of TPM).
local function token_rate(m)
  local t = eff_tpm(m)
  return t - math.min(m.ext, math.floor(t * 9 / 10))
end
local function window_ms(m)
  if m.window > 0 then return m.window end
  return CLEAN_MS
end

-- One clean window's raise of learned limit l (0: none), by 1/20 of the level
-- the last 429 lowered it from; at `ceiling` (the limit without learning, 0:
-- none) it is forgotten.
local function step_of(peak) return math.max(1, math.ceil(peak / 20)) end
local function raised(l, peak, steps, ceiling)
  if l == 0 then return 0 end
  l = l + steps * step_of(peak)
  if ceiling == 0 or l >= ceiling then return 0 end
  return l
end

-- Each window of clean traffic (no 429 lowered anything) since the last raise
-- or lowering raises every learned limit one step, back toward the quota.
local function relax(m, now)
  if m.learn ~= 1 or (m.ltpm == 0 and m.lrpm == 0 and m.lcap == 0) then return end
  local since, w = math.max(m.raised_at, m.lowered_at), window_ms(m)
  if now - since < w then return end
  local steps = math.floor((now - since) / w)
  m.ltpm = raised(m.ltpm, m.ptpm, steps, lower_of(m.tpm, m.htpm))
  m.lrpm = raised(m.lrpm, m.prpm, steps, lower_of(m.rpm, m.hrpm))
  m.lcap = raised(m.lcap, m.pcap, steps, m.cap)
  m.raised_at = since + steps * w
end

-- Transit allowance. A call reaches the provider up to TRANSIT_MS after its
-- admission charged our bucket. While the provider's bucket sits full it
-- wastes refill that ours, charged earlier, keeps, so a bucket as large as the
-- provider's runs ahead of it by up to TRANSIT_MS of refill. Ours is capped
-- that much lower (never by more than half the burst); a task larger than the
-- cap needs a full bucket.
local TRANSIT_MS = 250
local function token_cap(m)
  local b = eff_burst(m) * UNITS
  return b - math.min(eff_tpm(m) * TRANSIT_MS, math.floor(b / 2))
end
local function tokens_needed(m, est) return math.min(est * UNITS, token_cap(m)) end

-- Refill the buckets at the effective rates up to now, then raise learned limits (relax).
local function refill(m, now)
  local dt = now - m.refilled_at
  if dt < 0 then dt = 0 end
  m.tokens = math.min(token_cap(m), m.tokens + dt * token_rate(m))
  local rpm = eff_rpm(m)
  if rpm > 0 then m.requests = math.min(eff_rburst(m) * UNITS, m.requests + dt * rpm) end
  if now > m.refilled_at then m.refilled_at = now end
  relax(m, now)
end

-- Credits (refunds, settlement surpluses) go back only to the quota generation
-- that charged them: after a rate or burst change, tokens charged under the
-- old quota must not inflate the new, possibly much smaller, bucket.
local function same_generation(m, lease) return lease.g == m.gen end

-- Give back what an admission charged, for a call that never happened.
local function refund(m, lease)
  if not same_generation(m, lease) then return end
  local est = lease.e
  m.tokens = math.min(token_cap(m), m.tokens + est * UNITS)
  if eff_rpm(m) > 0 then m.requests = math.min(eff_rburst(m) * UNITS, m.requests + UNITS) end
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

-- Slow start (balancer.admission.learned.ramp_cap): a learning model's (with slow_start) new or
-- changed quota opens max(RAMP_START, ramp_from) slots, doubling every RAMP_MS
-- from ramp_at (the first call's start under it), up to the cap; a 429 that
-- lowered a limit (lowered_at) ends it.
local function ramp_cap(m, cap, now)
  if m.learn ~= 1 or m.slow_start ~= 1 or m.lowered_at > 0 then return cap end
  local start = math.max(RAMP_START, m.ramp_from)
  local steps = 0
  if m.ramp_at > 0 then steps = math.floor(math.max(0, now - m.ramp_at) / RAMP_MS) end
  if steps >= 16 or start * 2 ^ steps >= cap then return cap end
  return start * 2 ^ steps
end
-- ms until slow start's next step (learned.ramp_wait_ms): RAMP_MS before its clock starts.
local function ramp_wait(m, now)
  if m.ramp_at == 0 then return RAMP_MS end
  return RAMP_MS - math.max(0, now - m.ramp_at) % RAMP_MS
end
-- A quota set (or restored) starts a slow start from its live calls in flight
-- (their slots stay open, so one ending lets the next call start, and that
-- start begins the steps' clock: count_start).
local function ramp_quota(m, now)
  m.ramp_from = redis.call('ZCOUNT', inflight_key(m.name), '(' .. fmt(now), '+inf')
  m.ramp_at = 0
end

-- The circuit breaker (trip.lua): while a model's circuit is open it is paused,
-- then probed with one call at a time until a call is answered.
local function slot_cap(m, now)
  if m.probing == 1 then return 1 end
  return ramp_cap(m, eff_cap(m), now)
end

-- A model paused by a 429 takes nothing until the pause ends, whichever limit caused it.
local function has_capacity(m, est, now)
  return m.paused <= now
     and redis.call('ZCARD', inflight_key(m.name)) < slot_cap(m, now)
     and m.tokens >= tokens_needed(m, est)
     and (eff_rpm(m) == 0 or m.requests >= UNITS)
end

-- ms until m has a slot, the tokens and a request for est, and no pause.
local function wait_ms(m, est, now)
  local w = math.max(0, m.paused - now)
  local need = tokens_needed(m, est)
  if m.tokens < need then w = math.max(w, math.ceil((need - m.tokens) / token_rate(m))) end
  local rpm = eff_rpm(m)
  if rpm > 0 and m.requests < UNITS then
    w = math.max(w, math.ceil((UNITS - m.requests) / rpm))
  end
  local key = inflight_key(m.name)
  local n, cap = redis.call('ZCARD', key), slot_cap(m, now)
  if n >= cap then
    local r = redis.call('ZRANGE', key, n - cap, n - cap, 'WITHSCORES')
    local slot = tonumber(r[2]) - now
    if m.probing ~= 1 and cap < eff_cap(m) then slot = math.min(slot, ramp_wait(m, now)) end
    w = math.max(w, slot)
  end
  return w
end

local function charge(m, est)
  m.tokens = m.tokens - est * UNITS
  if eff_rpm(m) > 0 then m.requests = m.requests - UNITS end
end

-- The token gate: a second token bucket, charged when a call *starts* (renew),
-- as the provider charges it on arrival. Admission charges the first bucket
-- early; calls that then wait in the broker or a busy worker start in bunches
-- that the provider would refuse. This one refills, settles and syncs like the
-- first, and delays a start until the provider has the tokens for it.
local function refill_started(m, now)
  local dt = now - m.prefilled_at
  if dt < 0 then dt = 0 end
  m.ptokens = math.min(token_cap(m), m.ptokens + dt * token_rate(m))
  if now > m.prefilled_at then m.prefilled_at = now end
end

local function token_gate(m, est, now)
  refill_started(m, now)
  local need = tokens_needed(m, est)
  local wait = 0
  if m.ptokens < need then wait = math.ceil((need - m.ptokens) / token_rate(m)) end
  m.ptokens = m.ptokens - est * UNITS
  return wait
end

-- The gate's interval and burst tolerance, ms (balancer.admission.values.gate_shape).
-- The last hop (renew to the provider) jitters too: keep up to 20 ms of it in hand.
local function gate_shape(m)
  local interval = math.ceil(60000 / eff_rpm(m))
  return interval, math.max(0, (eff_rburst(m) - 1) * interval - math.min(math.ceil(interval / 2), 20))
end

-- The start gate (GCRA): calls *start* at most RPM per minute with at most
-- rburst at once, timed at renew, just before the HTTP call. Admission already
-- paces the request bucket, but the hops between admission and the call
-- (broker, queue, worker) bunch calls up; a provider checking RPM over 1 s sees
-- those bunches. Returns ms the caller must wait before calling (0 = now).
local function start_gate(m, now)
  local rpm = eff_rpm(m)
  if rpm <= 0 then return 0 end
  local interval, tolerance = gate_shape(m)
  local start = math.max(now, m.tat - tolerance)
  m.tat = math.max(m.tat, start) + interval
  return start - now
end

-- The first bucket (see first_bucket_rate): the calls started under the quota, and their tokens.
local function count_start(m, est, now)
  if m.first_at == 0 then m.first_at = now end
  if m.ramp_at == 0 then m.ramp_at = now end
  m.first_calls, m.first_tokens = m.first_calls + 1, m.first_tokens + est
end

-- Both gates for a call about to start: ms to wait before calling. A first start
-- passes the token gate and counts toward the first bucket (count_start); a
-- restart (redelivery) was counted already.
local function start_delay(m, est, first_start, now)
  local wait = 0
  if first_start then
    wait = token_gate(m, est, now)
    count_start(m, est, now)
  end
  return wait + start_gate(m, now + wait)
end

-- Lower the buckets to the provider's x-ratelimit-remaining-* ('' = not sent); never raise them.
-- The token gap between two syncs is what others used of the quota meanwhile:
-- its rate moves `ext`, and the bucket refills at tpm - ext (never below a
-- tenth of tpm), so a steady outside user is expected, not met as a 429 after
-- every sync. Biased to the safe side: an outside user shows as a positive gap
-- and moves ext up by 1/4 of it; calls we charged that have not reached the
-- provider yet show as a negative gap, so down moves take only 1/32.
-- m must be refilled to now first.
local function sync_to_headers(m, now, remaining_tokens, remaining_requests)
  if remaining_tokens ~= '' then
    local remaining = tonumber(remaining_tokens) * UNITS
    if m.synced_at > 0 and now > m.synced_at then
      local gap = m.tokens - remaining
      local gain = 4
      if gap < 0 then gain = 32 end
      local error_rate = math.floor(gap / (gain * (now - m.synced_at)))
      m.ext = math.max(0, math.min(math.floor(eff_tpm(m) * 9 / 10), m.ext + error_rate))
    end
    m.synced_at = now
    m.tokens = math.min(m.tokens, remaining)
    refill_started(m, now)
    m.ptokens = math.min(m.ptokens, remaining)
  end
  if remaining_requests ~= '' and eff_rpm(m) > 0 then
    local left = tonumber(remaining_requests)
    m.requests = math.min(m.requests, left * UNITS)
    -- The start gate too: at most `left` more starts now. The bucket's count
    -- forgets calls admitted but not started (charged here, unknown to the
    -- provider); the gate counts starts, so they wait at their start.
    local interval, tolerance = gate_shape(m)
    m.tat = math.max(m.tat, now + tolerance - (left - 1) * interval)
  end
end

-- The provider's x-ratelimit-limit-tokens / -requests ('' = not sent), with
-- learn = 1: they cap the effective limits, and give an RPM to a quota that
-- has none. A changed one makes what 429s taught of that kind stale: forgotten.
-- A new token limit also restarts the outside-use estimate (ext, synced_at):
-- the gaps seen while the old limit held measured our own overdraft, not others.
local function sync_limits(m, limit_tokens, limit_requests)
  if m.learn ~= 1 then return end
  if limit_tokens ~= '' then
    local h = tonumber(limit_tokens)
    if h > 0 and h ~= m.htpm then
      if m.htpm > 0 then m.ltpm, m.ptpm, m.window = 0, 0, 0 end
      if lower_of(m.tpm, h) ~= lower_of(m.tpm, m.htpm) then m.ext, m.synced_at = 0, 0 end
      m.htpm = h
    end
  end
  if limit_requests ~= '' then
    local h = tonumber(limit_requests)
    if h > 0 and h ~= m.hrpm then
      if m.hrpm > 0 then m.lrpm, m.prpm, m.window = 0, 0, 0 end
      m.hrpm = h
    end
  end
end

-- The model's calls in flight: how many, their estimated tokens, and how many
-- started (reached for the provider: what it can have counted).
local function inflight_stats(m)
  local lids = redis.call('ZRANGE', inflight_key(m.name), 0, -1)
  local sum, n, sent = 0, #lids, 0
  for _, lid in ipairs(lids) do
    local raw = redis.call('HGET', LEASES, lid)
    if raw then
      local lease = cjson.decode(raw)
      sum = sum + lease.e
      if lease.s == 1 then sent = sent + 1 end
    end
  end
  return n, sum, sent
end

-- An answered call of a learning model ends with `sent` calls started in flight
-- (itself included): the provider served that many at once, at most. The most
-- it served at once is kept while it is seen again within CLEAN_MS
-- (balancer.admission.learned.note_served). No call is counted while fewer are
-- in flight than that most.
local function note_served(m, now)
  if m.learn ~= 1 then return end
  local fresh = now - m.served_at < CLEAN_MS
  if fresh and redis.call('ZCARD', inflight_key(m.name)) < m.served then return end
  local _, _, sent = inflight_stats(m)
  if sent >= m.served or not fresh then m.served, m.served_at = sent, now end
end

-- The provider lately served more calls at once than the `sent` that had
-- started when a 429 came back: that 429 was not for concurrency (learned.served_more).
local function served_more(m, now, sent)
  return sent < m.served and now - m.served_at < CLEAN_MS
end

-- The kind of limit behind a 429: 'REQUESTS', 'TOKENS' or 'CONCURRENCY' (upper case: not the hash's fields).
-- From the headers when they say: no request left; fewer tokens left than
-- the model's calls in flight average; both left (so the provider counted
-- calls in progress). Otherwise the lowest of our own buckets, as a share of
-- its size (free slots for concurrency, of the cap in force: slow start's while
-- it ramps); ties go to requests, then tokens. Concurrency is ruled out when
-- the provider lately served more calls at once than had started (served_more).
-- Also returns how many calls in flight started (reached for the provider:
-- what it can have counted).
local function limit_kind(m, now, remaining_tokens, remaining_requests)
  local n, sum, sent = inflight_stats(m)
  local kind
  if remaining_requests ~= '' and tonumber(remaining_requests) < 1 then kind = 'REQUESTS'
  elseif remaining_tokens ~= '' and tonumber(remaining_tokens) * n < sum then kind = 'TOKENS'
  elseif remaining_tokens ~= '' and (remaining_requests ~= '' or eff_rpm(m) == 0) then kind = 'CONCURRENCY'
  else
    local ft = m.tokens / token_cap(m)
    if remaining_tokens ~= '' then ft = tonumber(remaining_tokens) * UNITS / token_cap(m) end
    local fr = math.huge
    if eff_rpm(m) > 0 then
      fr = m.requests / (eff_rburst(m) * UNITS)
      if remaining_requests ~= '' then fr = tonumber(remaining_requests) * UNITS / (eff_rburst(m) * UNITS) end
    end
    local cap = ramp_cap(m, eff_cap(m), now)  -- the cap in force: slow start's while it ramps
    local fc = (cap - n) / cap
    if served_more(m, now, sent) then fc = math.huge end
    if fr <= ft and fr <= fc then kind = 'REQUESTS'
    elseif ft <= fc then kind = 'TOKENS'
    else kind = 'CONCURRENCY' end
  end
  return kind, sent
end

-- The first bucket. From the first call a model starts under its quota
-- (first_at; first_calls and first_tokens count the calls started since and
-- their estimated tokens) until one bucket's time (size / rate) has passed, a
-- 429 for tokens or requests shows the provider's rate: a provider whose
-- bucket has the quota's shape ran out once our calls had taken `n` (tokens or
-- calls) in `t` ms, so its rate is about rate * n / (size + rate * t); 0 once
-- the first bucket is over or before any call
-- (balancer.admission.learned.first_bucket_rate).
local function first_bucket_rate(rate, size, n, t)
  if rate <= 0 or n <= 0 or t * rate >= size * 60000 then return 0 end
  return math.max(1, math.floor(rate * n * 60000 / (size * 60000 + rate * t)))
end

-- What a 429 that starts a pause does to a rate at `level` (balancer.admission.learned.lowered):
-- lowers it to 7/10, remembering `level` (the raises' step); within the first
-- bucket (`shown` > 0: the rate it shows) to 7/10 of that, once: a 429 that
-- would not take it below `level` leaves it (nil).
local function lowered(level, shown)
  if shown <= 0 then return level, math.max(1, math.floor(level * 7 / 10)) end
  local to = math.max(1, math.floor(shown * 7 / 10))
  if to < level then return math.min(shown, level), to end
  return nil
end

-- A 429 for tokens or requests from a provider that does not say what is left
-- says nothing is: that bucket (both token buckets for tokens) is emptied, as
-- sync_to_headers would with a remaining count of 0. m must be refilled to now.
local function empty_after_429(m, now, kind, remaining_tokens, remaining_requests)
  if m.learn ~= 1 then return end
  if kind == 'TOKENS' and remaining_tokens == '' then
    refill_started(m, now)
    m.tokens, m.ptokens = math.min(m.tokens, 0), math.min(m.ptokens, 0)
  elseif kind == 'REQUESTS' and remaining_requests == '' and eff_rpm(m) > 0 then
    m.requests = math.min(m.requests, 0)
  end
end

-- A 429 that paused the model (once per window: `started`) lowers the
-- effective limit of its kind to 7/10 of the level it was at (concurrency:
-- of the started calls in flight, if any and fewer), at least 1, and remembers that
-- level (the raises' step). Within the first bucket tokens or requests go to
-- 7/10 of the rate it shows (first_bucket_rate), once (see lowered). A 429
-- within a window of a raise says the raise went too far: a kind it raised
-- goes back one step (the level before the raise worked), not to 7/10, and
-- the next raise waits twice as long (up to MAX_WINDOW_MS). Every other 429 for concurrency
-- says the started calls in flight were at least one too many: the cap goes
-- no higher than that, less one. A kind whose limit the provider states
-- (x-ratelimit-limit-*: htpm, hrpm) is not lowered: it is known, and its 429
-- was a race the pause covers. m must be refilled to now.
local function learn_from_429(m, now, kind, sent, started)
  if m.learn ~= 1 then return end
  if (kind == 'TOKENS' and m.htpm > 0) or (kind == 'REQUESTS' and m.hrpm > 0) then return end
  if not started then
    if kind == 'CONCURRENCY' and sent > 1 and sent - 1 < eff_cap(m) then
      if m.lcap == 0 then m.pcap = eff_cap(m) end
      m.lcap = math.max(1, sent - 1)
      m.lowered_at = now
    end
    return
  end
  local w = window_ms(m)
  local probed = m.raised_at > m.lowered_at and now - m.raised_at < w
  if probed then m.window = math.min(w * 2, MAX_WINDOW_MS) end
  local t = now - m.first_at
  if kind == 'TOKENS' and probed and m.ltpm > 0 then
    m.ltpm = math.max(1, m.ltpm - step_of(m.ptpm))
  elseif kind == 'TOKENS' then
    local from, to = lowered(eff_tpm(m), first_bucket_rate(m.tpm, m.burst, m.first_tokens, t))
    if from then m.ptpm, m.ltpm = from, to end
  elseif kind == 'REQUESTS' and probed and m.lrpm > 0 then
    m.lrpm = math.max(1, m.lrpm - step_of(m.prpm))
  elseif kind == 'REQUESTS' then
    if eff_rpm(m) == 0 then return end
    local from, to = lowered(eff_rpm(m), first_bucket_rate(m.rpm, m.rburst, m.first_calls, t))
    if from then m.prpm, m.lrpm = from, to end
  elseif probed and m.lcap > 0 then
    m.lcap = math.max(1, m.lcap - step_of(m.pcap))
  else
    m.pcap = eff_cap(m)
    if sent > 0 then m.pcap = math.min(m.pcap, sent) end
    m.lcap = math.max(1, math.floor(m.pcap * 7 / 10))
  end
  m.lowered_at = now
end

local function put_lease(lid, m, est, deadline, started)
  redis.call('ZADD', inflight_key(m.name), fmt(deadline), lid)
  redis.call('HSET', LEASES, lid, cjson.encode({m = m.name, e = est, s = started, g = m.gen}))
end

-- Ready lists (<tag>:ready:<name>, filled by stock.lua): tasks the dispatcher
-- placed on a model ahead of a free slot, so that a slot freed by finish.lua
-- carries the next call at once, with no trip through the dispatcher. Entries
-- are 'task:lid:est:expires_ms', oldest first. Taking one
-- is a full admission on that model (enabled, no pause, a slot, tokens, a
-- request), outside WDRR: the dispatcher chose the model when it stocked it.
local function ready_key(name) return PREFIX .. READY_INFIX .. name end

local function parse_ready(raw)
  local task, lid, est, expires = string.match(raw, '^([^:]+):([^:]+):([^:]+):([^:]+)$')
  return {task = task, lid = lid, e = tonumber(est), x = tonumber(expires)}
end

-- Take up to `limit` entries from the head of m's ready list while m can admit
-- them now, charging and leasing each (`started`: 1 when the caller calls at
-- once, as after renew). With `drop`, expired heads are dropped, and so is
-- every entry m can never take as it stands (disabled, or above its burst):
-- the caller returns their tasks to pending. Without it, such a head stops
-- the take, as does the first entry that must wait. m must be refilled and
-- purged to now.
local function take_ready(m, now, lease_ms, started, limit, drop, taken, dropped)
  local key = ready_key(m.name)
  while #taken < limit do
    local raw = redis.call('LINDEX', key, 0)
    if not raw then break end
    local r = parse_ready(raw)
    if drop and (r.x <= now or m.enabled ~= 1 or r.e > m.burst) then
      redis.call('LPOP', key)
      dropped[#dropped + 1] = r
    elseif r.x > now and m.enabled == 1 and r.e <= m.burst and has_capacity(m, r.e, now) then
      redis.call('LPOP', key)
      charge(m, r.e)
      put_lease(r.lid, m, r.e, now + lease_ms, started)
      taken[#taken + 1] = r
    else
      break
    end
  end
end
-- Add one finished call to its model's latency sketch: decay every field by
-- 1/64 (integer floor), then add the sample. The bucket index comes from the
-- caller (balancer.domain.latency.bucket_of), so this is integer arithmetic
-- only, exactly as balancer.domain.latency.record does it.
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

-- limits.lua: what a model admits under (after state.lua; see there for the
-- library's order): its effective limits (the quota's, or lower where it
-- learned so) and their relaxing back, the token and request buckets (refill,
-- refunds, expired leases), slow start and the circuit's probe (the slots
-- open), capacity and the wait until it, and the token and start gates a
-- call passes when it starts.

-- Limits that learn. A model's effective limits are its quota's, or lower:
-- with learn = 1, the provider's x-ratelimit-limit-* headers (htpm, hrpm) cap
-- them, and give an RPM to a quota that leaves it unset; a 429 lowers the kind
-- that caused it (ltpm, lrpm, lcap: see learn_from_429), and clean windows
-- raise it back (relax). Bucket sizes scale with their rates. Every rule below
-- reads these, never the quota's fields directly, except the burst that
-- decides whether a task can ever fit (the configured one).
-- (CLEAN_MS, MAX_WINDOW_MS, PEAK_WINDOWS, RAMP_START, RAMP_MS and FIRST_BUCKETS come from learned.py's
-- prelude; UNITS, TRANSIT_MS, GATE_HOP_MS, SYNC_LAG_MS, OUTSIDE_MARGIN_MS and OUTSIDE_TAU_MS from values.py's.)
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
-- The most others' use is ever taken to be: 9/10 of `tpm` (values.outside_ceiling).
local function outside_ceiling(tpm) return math.floor(tpm * 9 / 10) end
-- What others use that the token bucket allows for: ext, at most 9/10 of TPM, and
-- none while the estimate is below 0 (values.outside_rate).
local function outside_rate(m) return math.max(0, math.min(m.ext, outside_ceiling(eff_tpm(m)))) end
-- Tokens per minute the bucket refills at: TPM less what others use (never below a tenth of TPM).
local function token_rate(m) return eff_tpm(m) - outside_rate(m) end
local function window_ms(m)
  if m.window > 0 then return m.window end
  return CLEAN_MS
end

-- One clean window's raise of learned limit l (0: none), by 1/20 of the level
-- the last 429 lowered it from (its peak), if it has bound for a window since `since`
-- (bound_at: it first bound then, at least w ms ago); a step to the peak or past
-- it waits PEAK_WINDOWS windows. At `ceiling` (the limit without learning, 0: none)
-- it is forgotten.
local function step_of(peak) return math.max(1, math.ceil(peak / 20)) end
local function raised(l, peak, ceiling, bound_at, since, now, w)
  if l + step_of(peak) >= peak then w = w * PEAK_WINDOWS end
  if l == 0 or bound_at == 0 or bound_at < since or now - bound_at < w then return l end
  l = l + step_of(peak)
  if ceiling == 0 or l >= ceiling then return 0 end
  return l
end

-- A clean window (no 429 lowered anything since the last raise or lowering)
-- raises every learned limit that has bound for a window since then one step,
-- back toward the quota, and raised_at is now (balancer.admission.learned.relaxed).
-- A limit the traffic did not reach is not raised.
local function relax(m, now)
  if m.learn ~= 1 or (m.ltpm == 0 and m.lrpm == 0 and m.lcap == 0) then return end
  local since, w = math.max(m.raised_at, m.lowered_at), window_ms(m)
  if now - since < w then return end
  local ltpm = raised(m.ltpm, m.ptpm, lower_of(m.tpm, m.htpm), m.bound_tpm, since, now, w)
  local lrpm = raised(m.lrpm, m.prpm, lower_of(m.rpm, m.hrpm), m.bound_rpm, since, now, w)
  local lcap = raised(m.lcap, m.pcap, m.cap, m.bound_cap, since, now, w)
  if ltpm == m.ltpm and lrpm == m.lrpm and lcap == m.lcap then return end
  m.ltpm, m.lrpm, m.lcap, m.raised_at = ltpm, lrpm, lcap, now
end

-- Transit allowance. A call reaches the provider up to TRANSIT_MS after its
-- admission charged our bucket. While the provider's bucket sits full it
-- wastes refill that ours, charged earlier, keeps, so a bucket as large as the
-- provider's runs ahead of it by up to TRANSIT_MS of refill. Ours is capped
-- that much lower (never by more than half the burst); a task larger than the
-- cap needs a full bucket. (TRANSIT_MS: balancer.admission.values.)
local function token_cap(m)
  local b = eff_burst(m) * UNITS
  return b - math.min(eff_tpm(m) * TRANSIT_MS, math.floor(b / 2))
end
-- Units a task needs: its estimate and, when others use the quota, their use of
-- OUTSIDE_MARGIN_MS; a full bucket if larger (values.tokens_needed).
local function tokens_needed(m, est)
  return math.min(est * UNITS + outside_rate(m) * OUTSIDE_MARGIN_MS, token_cap(m))
end

-- The gate's interval and burst tolerance, ms (balancer.admission.values.gate_shape).
-- The last hop (renew to the provider) jitters too: keep up to GATE_HOP_MS of it in hand.
local function gate_shape(m)
  local interval = math.ceil(60000 / eff_rpm(m))
  return interval, math.max(0, (eff_rburst(m) - 1) * interval - math.min(math.ceil(interval / 2), GATE_HOP_MS))
end

-- Units of requests the start gate starts within one interval of now: the most the request
-- bucket holds (balancer.admission.values.gate_room). Calls the gate has booked are calls
-- the bucket cannot admit again; held so, the tasks stay pending for any model.
local function gate_room(m, now)
  local _, tolerance = gate_shape(m)
  return (now + tolerance - m.tat) * eff_rpm(m) + 2 * UNITS
end

-- Refill the buckets at the effective rates up to now (requests up to the start gate's room),
-- then raise learned limits (relax);
-- admissions WINDOW_MS old leave the window (window.lua).
local function refill(m, now)
  local dt = now - m.refilled_at
  if dt < 0 then dt = 0 end
  m.tokens = math.min(token_cap(m), m.tokens + dt * token_rate(m))
  local rpm = eff_rpm(m)
  if rpm > 0 then m.requests = math.min(eff_rburst(m) * UNITS, m.requests + dt * rpm, gate_room(m, now)) end
  if now > m.refilled_at then m.refilled_at = now end
  relax(m, now)
  window_expire(m, now)
end

-- Credits (refunds, settlement surpluses) go back only to the quota generation
-- that charged them: after a rate or burst change, tokens charged under the
-- old quota must not inflate the new, possibly much smaller, bucket.
local function same_generation(m, lease) return lease.g == m.gen end

-- Give back what an admission charged, for a call that never happened (its request up to the
-- start gate's room, as refill: the admission that follows in the same script must not find
-- one request more than the gate starts within an interval).
local function refund(m, lease, now)
  if not same_generation(m, lease) then return end
  local est = lease.e
  m.tokens = math.min(token_cap(m), m.tokens + est * UNITS)
  if eff_rpm(m) > 0 then m.requests = math.min(eff_rburst(m) * UNITS, m.requests + UNITS, gate_room(m, now)) end
end

-- Drop expired leases. One never started (no worker renewed it) made no call,
-- so its tokens and request go back to the buckets (refund).
local function purge(m, now)
  local key = inflight_key(m.name)
  local expired = redis.call('ZRANGEBYSCORE', key, '-inf', fmt(now))
  for _, lid in ipairs(expired) do
    local raw = redis.call('HGET', LEASES, lid)
    if raw then
      local lease = cjson.decode(raw)
      if lease.s == 0 then refund(m, lease, now) end
      redis.call('HDEL', LEASES, lid)
    end
  end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(now)) end
end

-- Slow start (balancer.admission.learned.ramp_cap): a learning model's (with slow_start) new or
-- changed quota opens max(RAMP_START, ramp_from) slots, doubling every RAMP_MS
-- from ramp_at (the first call's start under it), one slot at a time within a
-- step, up to the cap; a 429 that lowered a limit (lowered_at) ends it.
local function ramp_cap(m, cap, now)
  if m.learn ~= 1 or m.slow_start ~= 1 or m.lowered_at > 0 then return cap end
  local start = math.max(RAMP_START, m.ramp_from)
  local elapsed = 0
  if m.ramp_at > 0 then elapsed = math.max(0, now - m.ramp_at) end
  local steps, into = math.floor(elapsed / RAMP_MS), elapsed % RAMP_MS
  if steps >= 16 or start * 2 ^ steps >= cap then return cap end
  local base = start * 2 ^ steps
  return math.min(cap, base + math.floor(base * into / RAMP_MS))
end
-- ms until slow start opens its next slot (learned.ramp_wait_ms): RAMP_MS before its clock starts.
local function ramp_wait(m, now)
  if m.ramp_at == 0 then return RAMP_MS end
  local elapsed = math.max(0, now - m.ramp_at)
  local steps, into = math.floor(elapsed / RAMP_MS), elapsed % RAMP_MS
  local base = math.max(RAMP_START, m.ramp_from) * 2 ^ math.min(steps, 16)
  local opened = math.floor(base * into / RAMP_MS)
  return math.min(RAMP_MS, math.ceil((opened + 1) * RAMP_MS / base)) - into
end
-- A quota set (or restored) starts a slow start from its live calls in flight
-- (their slots stay open, so one ending lets the next call start, and that
-- start begins the steps' clock: count_start), or from as many as the provider
-- served at once within CLEAN_MS, if more: those slots are not in doubt
-- (balancer.admission.learned.ramp_start).
local function ramp_quota(m, now)
  local live = redis.call('ZCOUNT', inflight_key(m.name), '(' .. fmt(now), '+inf')
  if now - m.served_at < CLEAN_MS and m.served > live then live = m.served end
  m.ramp_from = live
  m.ramp_at = 0
end

-- The circuit breaker (trip.lua): while a model's circuit is open it is paused,
-- then probed with one call at a time until a call is answered.
local function slot_cap(m, now)
  if m.probing == 1 then return 1 end
  return ramp_cap(m, eff_cap(m), now)
end

-- A limit found short (false) binds now: bound_* keeps the first time it did
-- since the last raise or lowering (learned.note_bound); relax raises only a
-- limit that has bound for a window.
local function note_bound(m, now, slots, tokens, requests)
  local since = math.max(m.raised_at, m.lowered_at)
  if not slots and m.bound_cap < since then m.bound_cap = now end
  if not tokens and m.bound_tpm < since then m.bound_tpm = now end
  if not requests and m.bound_rpm < since then m.bound_rpm = now end
end

-- A model paused by a 429 takes nothing until the pause ends, whichever limit caused it.
-- Otherwise each limit a call finds short binds now (note_bound). A window cap must fit
-- too (window.lua); it binds no learned limit.
local function has_capacity(m, est, now)
  if m.paused > now then return false end
  local slots = redis.call('ZCARD', inflight_key(m.name)) < slot_cap(m, now)
  local tokens = m.tokens >= tokens_needed(m, est)
  local requests = eff_rpm(m) == 0 or m.requests >= UNITS
  note_bound(m, now, slots, tokens, requests)
  return slots and tokens and requests and window_fits(m, m.wtokens, m.wcalls, est)
end

-- ms until m has a slot, the tokens and a request for est, room in its window, and no pause.
local function wait_ms(m, est, now)
  local w = math.max(0, m.paused - now, window_wait(m, est, now))
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

local function charge(m, est, now)
  m.tokens = m.tokens - est * UNITS
  if eff_rpm(m) > 0 then m.requests = m.requests - UNITS end
  window_add(m, est, now)
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

-- The first bucket and the recent count (shown.lua): the calls started under
-- the quota, and their tokens.
local function count_start(m, est, now)
  if m.first_at == 0 then m.first_at = now end
  if m.ramp_at == 0 then m.ramp_at = now end
  m.first_calls, m.first_tokens = m.first_calls + 1, m.first_tokens + est
  count_recent(m, est, now)
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

-- shown.lua: the provider's rate, as our own call starts show it when its 429
-- comes (balancer/admission/shown.py, which says why each bound holds): the first
-- bucket's rate, and our rate over the recent count's span.

-- The recent count's step: RECENT_STEP_MS, or half the quota's shorter bucket
-- time if less, at least 1 ms (shown.recent_step_ms). The count spans one or two steps.
local function recent_step(m)
  local t = math.min(RECENT_STEP_MS * 2, math.floor(m.burst * 60000 / m.tpm))
  if m.rpm > 0 then t = math.min(t, math.floor(m.rburst * 60000 / m.rpm)) end
  return math.max(1, math.floor(t / 2))
end

-- Whole steps of `step` ms from `at` to now (0: none counted, or a clock behind; shown.steps_since).
local function steps_since(at, step, now)
  if at == 0 then return 0 end
  return math.floor(math.max(0, now - at) / step)
end

-- One more call of `est` tokens started at `now` (shown.counted): one step on,
-- the current step's count becomes the one before it; two, both start again.
-- Each step keeps its first call's start (recent_first_at, before_first_at).
local function count_recent(m, est, now)
  local step = recent_step(m)
  local steps = steps_since(m.recent_at, step, now)
  if steps > 0 then
    if steps == 1 then
      m.before_first_at, m.before_calls, m.before_tokens = m.recent_first_at, m.recent_calls, m.recent_tokens
    else
      m.before_first_at, m.before_calls, m.before_tokens = 0, 0, 0
    end
    m.recent_at, m.recent_first_at, m.recent_calls, m.recent_tokens = m.recent_at + steps * step, 0, 0, 0
  end
  if m.recent_at == 0 then m.recent_at = now end
  if m.recent_first_at == 0 then m.recent_first_at = now end
  m.recent_calls, m.recent_tokens = m.recent_calls + 1, m.recent_tokens + est
end

-- The first bucket. From the first call a model starts under its quota
-- (first_at; first_calls and first_tokens count the calls started since and
-- their estimated tokens) until FIRST_BUCKETS bucket times (size / rate each)
-- have passed, a 429 for tokens or requests shows the provider's rate: a
-- provider whose bucket has the quota's shape, full at the first call and
-- drained since, ran out once our calls had taken `n` (tokens or
-- calls) in `t` ms, so its rate is about rate * n / (size + rate * t); 0 once
-- FIRST_BUCKETS bucket times have passed, or before any call; a `t` below 0 (a
-- clock behind the first call's) reads as 0 (balancer.admission.shown.first_bucket_rate).
local function first_bucket_rate(rate, size, n, t)
  if t < 0 then t = 0 end
  if rate <= 0 or n <= 0 or t * rate >= FIRST_BUCKETS * size * 60000 then return 0 end
  return math.max(1, math.floor(rate * n * 60000 / (size * 60000 + rate * t)))
end

-- Our rate per minute, of calls (or `tokens`), over the recent count's span: the
-- current step and the one before it, one step on only the current one, two
-- steps on nothing (0), from the span's first call's start
-- (balancer.admission.shown.recent_rate). Whatever the provider's bucket held,
-- our calls over a bucket time or less emptied it and its refill when its 429
-- came: our rate is at least its rate.
local function recent_rate(m, now, tokens)
  local steps = steps_since(m.recent_at, recent_step(m), now)
  if m.recent_at == 0 or steps > 1 then return 0 end
  local n, since = m.recent_calls, m.recent_first_at
  if tokens then n = m.recent_tokens end
  if steps == 0 and m.before_calls > 0 then
    since = m.before_first_at
    if tokens then n = n + m.before_tokens else n = n + m.before_calls end
  end
  if n <= 0 then return 0 end
  return math.floor(n * 60000 / math.max(1, now - since))
end

-- What a 429 that starts a pause does to a rate at `level` (balancer.admission.shown.lowered):
-- lowers it to 7/10 of the lower of `level` and our `recent` rate, remembering that
-- (the raises' step); within the first bucket (`shown` > 0: the rate it shows) to
-- 7/10 of that, once: a 429 that would not take it below `level` leaves it (nil).
local function lowered(level, shown, recent)
  if shown <= 0 then
    local at = level
    if recent > 0 and recent < level then at = recent end
    return at, math.max(1, math.floor(at * 7 / 10))
  end
  local to = math.max(1, math.floor(shown * 7 / 10))
  if to < level then return math.min(shown, level), to end
  return nil
end


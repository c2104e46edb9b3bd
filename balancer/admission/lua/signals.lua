-- signals.lua: what the provider's answers teach a model (after limits.lua):
-- the x-ratelimit-remaining-* headers lower the buckets (sync_to_headers), the
-- x-ratelimit-limit-* headers cap the effective limits (sync_limits), an
-- answered call notes how many calls the provider served at once
-- (note_served), and a 429 is told apart by kind (limit_kind) and lowers the
-- limit of that kind (empty_after_429, learn_from_429).

-- The model's live calls the provider had not counted when it sent the headers
-- being synced: leases not started (charged to the admission buckets only), and
-- leases whose call starts after now - SYNC_LAG_MS (charged to the start gates
-- too: waiting at a gate, or on their way). Returns their tokens and number,
-- then those of the started ones; the call being finished (`own`, or nil) is
-- not one of them. A provider may take its counts as it admits a call, and send
-- them with its answer: then they are as old as that call (`own`), and miss
-- every call started after it. So also: when the call `own` started (nil: no
-- such call, or a 429's counts, taken as it refused), the tokens of the live
-- calls not started or started after it, and of every call started after it,
-- ended or live (from started_sum; nil if `own` has no sum: a restored lease)
-- (balancer.admission.reference.signals, _unarrived).
local function unarrived(m, now, own)
  local own_at, since_own = nil, nil
  local own_raw = own and redis.call('HGET', LEASES, own)
  if own_raw then
    local lease = cjson.decode(own_raw)
    if lease.s == 1 and (lease.a or 0) > 0 and lease.a < now then
      own_at = lease.a
      if lease.c then since_own = math.max(0, m.started_sum - lease.c - lease.e) end
    end
  end
  local tokens, calls, started_tokens, started_calls, aged_tokens = 0, 0, 0, 0, 0
  for _, lid in ipairs(redis.call('ZRANGEBYSCORE', inflight_key(m.name), '(' .. fmt(now), '+inf')) do
    local raw = redis.call('HGET', LEASES, lid)
    if raw and lid ~= own then
      local lease = cjson.decode(raw)
      local waiting = lease.s == 1 and (lease.a or 0) > now - SYNC_LAG_MS
      if lease.s == 0 or waiting then tokens, calls = tokens + lease.e, calls + 1 end
      if waiting then started_tokens, started_calls = started_tokens + lease.e, started_calls + 1 end
      if own_at and (lease.s == 0 or (lease.a or 0) > own_at) then aged_tokens = aged_tokens + lease.e end
    end
  end
  return tokens, calls, started_tokens, started_calls, own_at, aged_tokens, since_own
end

-- The outside-use estimate after a sync: moved by the gap's `growth` over
-- OUTSIDE_TAU_MS, or over `dt` when the syncs are further apart; while the count
-- is full (`count_full`: at least our bucket's size) it falls by at least
-- min(dt, OUTSIDE_TAU_MS) / OUTSIDE_TAU_MS of itself; between -1/10 and 9/10 of
-- TPM (values.outside_estimate says why).
local function outside_estimate(m, growth, dt, count_full)
  dt = math.max(0, dt)
  local moved = math.floor(growth / math.max(OUTSIDE_TAU_MS, dt))
  if count_full and m.ext > 0 then
    moved = math.min(moved, -math.floor(m.ext * math.min(dt, OUTSIDE_TAU_MS) / OUTSIDE_TAU_MS))
  end
  local t = eff_tpm(m)
  return math.max(-math.floor(t / 10), math.min(outside_ceiling(t), m.ext + moved))
end

-- How much the token gap grew since the last sync left `sync_gap` (<= 0) (values.gap_growth says
-- why): a shrinking gap in full, a growing one only for its part above 0, where our bucket holds
-- more than the provider has left; below 0 a gap moves with each count's age, not with anyone's use.
local function gap_growth(gap, sync_gap)
  if gap < sync_gap then return gap - sync_gap end
  return math.max(gap, 0) - math.max(sync_gap, 0)
end

-- Whether the token bucket refills at the provider's rate, all of it ours: the quota
-- is taken as stated (learn off), or the provider stated its token limit (htpm),
-- which the effective TPM never exceeds; and no one else is seen using the quota
-- (ext <= 0) (balancer.admission.values.known_rate).
local function known_rate(m) return (m.learn ~= 1 or m.htpm > 0) and m.ext <= 0 end

-- Lower the buckets to the provider's x-ratelimit-remaining-* ('' = not sent),
-- the token buckets less what our calls it has not counted yet will take
-- (unarrived); never raise them.
-- The token gap (our level against the count less our calls on their way)
-- grows between two syncs by what others used beyond `ext` meanwhile: that
-- growth, its part above 0 only (gap_growth), moves `ext` (outside_estimate), and the bucket refills at tpm - ext
-- (never below a tenth of tpm), so a steady outside user is expected, not met
-- as a 429 after every sync. The gap a sync leaves
-- (sync_gap: the bucket is never raised, so a gap below 0 stays) is not counted
-- again at the next. The estimate may fall below 0, to a tenth of TPM: a count
-- the provider sent late reads as a gap below 0, then as one above it at the
-- next sync, and clamped at 0 only the second half was kept (an outside user
-- of 1 % of TPM on average, where there was none, on fast.toml). Only its part
-- above 0 is others' use (outside_rate).
-- `own`: the lease of the call whose answer carried them (finish.lua), or nil (a 429).
-- A count an answer carries may be as old as its call (a provider that counts as
-- it admits a call, a proxy's limiter): then what is left now is the count, plus
-- the refill since the call started, less our calls started since (unarrived).
-- The gap that moves `ext` is taken against whichever reading leaves more, and so
-- is the gap a sync leaves: a count's age is not read as someone else's use (with
-- counts taken at admission, one answer 2 s old read as others using all of a
-- TPM-bound model's TPM, and its bucket refilled at a tenth of it for seconds,
-- nothing in flight). The buckets are lowered to the count read as current, or,
-- when the refill rate is the provider's (known_rate), to the count plus the refill
-- since the call started less every call started since, ended ones too
-- (started_sum): never more than the provider can have left, yet not the count's
-- age taken off a bucket whose calls used less than the refill meanwhile.
-- Returns the requests left for more calls (nil: not sent, or no RPM), how
-- many of those on their way were not started, and when the call that carried
-- the counts started (nil: a 429's, or none): learn_from_spent.
-- m must be refilled to now first.
local function sync_to_headers(m, now, remaining_tokens, remaining_requests, own)
  if remaining_tokens == '' and remaining_requests == '' then return nil end
  local tokens, calls, started_tokens, started_calls, own_at, aged_tokens, since_own = unarrived(m, now, own)
  if remaining_tokens ~= '' then
    local remaining = tonumber(remaining_tokens) * UNITS
    local ours_left = remaining - tokens * UNITS  -- the count less our calls on their way
    local gate_left = remaining - started_tokens * UNITS  -- the count less our started calls on their way
    local explained = ours_left  -- or, for a count as old as the call that carried it, more
    if own_at then
      local refilled = math.min(token_cap(m), remaining + (now - own_at) * token_rate(m))
      explained = math.max(ours_left, refilled - aged_tokens * UNITS)
      if since_own and known_rate(m) then
        local arrived = math.max(0, since_own - started_tokens)  -- started since, and counted by now
        ours_left = math.max(ours_left, refilled - (arrived + tokens) * UNITS)
        gate_left = math.max(gate_left, refilled - (arrived + started_tokens) * UNITS)
      end
    end
    local gap = m.tokens - explained
    if m.synced_at > 0 then m.ext = outside_estimate(m, gap_growth(gap, m.sync_gap), now - m.synced_at, remaining >= token_cap(m)) end
    m.tokens = math.min(m.tokens, ours_left)
    m.synced_at, m.sync_gap = now, m.tokens - explained  -- (<= 0)
    refill_started(m, now)
    m.ptokens = math.min(m.ptokens, gate_left)
  end
  if remaining_requests ~= '' and eff_rpm(m) > 0 then
    -- The request bucket and the start gate go to the count itself: a whole
    -- request a call (the count is floored), against a provider's one-second
    -- window of two (azure-rpm1s), taking our calls on their way off it too cost
    -- a tenth of its throughput. Calls admitted but not started wait at the gate:
    -- at most `left` more starts now.
    local left = tonumber(remaining_requests)
    m.requests = math.min(m.requests, left * UNITS)
    local interval, tolerance = gate_shape(m)
    m.tat = math.max(m.tat, now + tolerance - (left - 1) * interval)
    return left - calls, calls - started_calls, own_at
  end
  return nil
end

-- Whether a limit header that differs from the one adopted is believed now
-- (balancer.admission.learned.believed): at least half the limit the model is
-- held to (`held`, 0: none), or confirmed: carried by a 429 (`confirmed`), or
-- stated again by a second reply (`candidate`: the one a reply stated last).
local function believed(h, held, candidate, confirmed)
  return confirmed or h == candidate or (held > 0 and h * 2 >= held)
end

-- The provider's x-ratelimit-limit-tokens / -requests ('' = not sent), with
-- learn = 1: they cap the effective limits, and give an RPM to a quota that
-- has none. One far below the limit the model is held to is not believed
-- until confirmed (believed; `confirmed`: a 429 carries it): it is kept as
-- the candidate (ctpm, crpm) a second reply must state again, so that one
-- reply cannot stall a model. A changed one makes what 429s taught of that kind stale: forgotten.
-- It also forgets the concurrency cap's peak (pcap, back to the quota's cap): no
-- header states concurrency, and a provider that changed its limits may have
-- changed that one too, so a lowered cap climbs back at one step a window, not
-- slowly at the level it was refused at (see PEAK_WINDOWS).
-- A new token limit also restarts the outside-use estimate (ext, synced_at):
-- the gaps seen while the old limit held measured our own overdraft, not others.
local function sync_limits(m, limit_tokens, limit_requests, confirmed)
  if m.learn ~= 1 then return end
  local changed = false
  if limit_tokens ~= '' then
    local h = tonumber(limit_tokens)
    if h > 0 and h ~= m.htpm and not believed(h, eff_tpm(m), m.ctpm, confirmed) then
      m.ctpm = h
    elseif h > 0 and h ~= m.htpm then
      if m.htpm > 0 then m.ltpm, m.ptpm, m.window, changed = 0, 0, 0, true end
      if lower_of(m.tpm, h) ~= lower_of(m.tpm, m.htpm) then m.ext, m.synced_at = 0, 0 end
      m.htpm, m.ctpm = h, 0
    elseif h > 0 then
      m.ctpm = 0
    end
  end
  if limit_requests ~= '' then
    local h = tonumber(limit_requests)
    if h > 0 and h ~= m.hrpm and not believed(h, eff_rpm(m), m.crpm, confirmed) then
      m.crpm = h
    elseif h > 0 and h ~= m.hrpm then
      if m.hrpm > 0 then m.lrpm, m.prpm, m.window, changed = 0, 0, 0, true end
      m.hrpm, m.crpm = h, 0
    elseif h > 0 then
      m.crpm = 0
    end
  end
  if changed and m.lcap > 0 then m.pcap = m.cap end
end

-- The model's calls in flight: how many, their estimated tokens, and how many
-- started (reached for the provider: what it can have counted); with `before`,
-- only those whose call started by then.
local function inflight_stats(m, live_at, before)
  local lids
  if live_at then  -- only leases live at live_at (deadline after it)
    lids = redis.call('ZRANGEBYSCORE', inflight_key(m.name), '(' .. fmt(live_at), '+inf')
  else
    lids = redis.call('ZRANGE', inflight_key(m.name), 0, -1)
  end
  local sum, n, sent = 0, #lids, 0
  for _, lid in ipairs(lids) do
    local raw = redis.call('HGET', LEASES, lid)
    if raw then
      local lease = cjson.decode(raw)
      sum = sum + lease.e
      if lease.s == 1 and (before == nil or (lease.a or 0) <= before) then sent = sent + 1 end
    end
  end
  return n, sum, sent
end

-- An answered call of a learning model ends with `sent` calls started in flight
-- and live (itself included; a dead worker's expired lease is not): the provider
-- served that many at once, at most. The most
-- it served at once is kept while it is seen again within CLEAN_MS
-- (balancer.admission.learned.note_served). No call is counted while fewer are
-- in flight than that most.
local function note_served(m, now)
  if m.learn ~= 1 then return end
  local fresh = now - m.served_at < CLEAN_MS
  if fresh and redis.call('ZCARD', inflight_key(m.name)) < m.served then return end
  local _, _, sent = inflight_stats(m, now)
  if sent >= m.served or not fresh then m.served, m.served_at = sent, now end
end

-- The provider lately served more calls at once than the `sent` that had
-- started when a 429 came back: that 429 was not for concurrency (learned.served_more).
local function served_more(m, now, sent)
  return sent < m.served and now - m.served_at < CLEAN_MS
end

-- When the refused call `lid` of model `name` started ('' or unknown: nil): the
-- calls the provider had when it refused it are those started by then.
local function refused_at(lid, name)
  local raw = lid ~= '' and redis.call('HGET', LEASES, lid)
  if not raw then return nil end
  local lease = cjson.decode(raw)
  if lease.m ~= name or lease.s ~= 1 or not lease.a then return nil end
  return lease.a
end

-- The kind of limit behind a 429: 'REQUESTS', 'TOKENS' or 'CONCURRENCY' (upper case: not the hash's fields).
-- From the headers when they say: no request left; fewer tokens left than
-- the model's calls in flight average; both left (so the provider counted
-- calls in progress). Otherwise the lowest of our own buckets, as a share of
-- its size (free slots for concurrency, of the cap in force: slow start's while
-- it ramps); ties go to requests, then tokens. Concurrency is ruled out when
-- the provider lately served more calls at once than had started (served_more).
-- Also returns how many calls in flight started (reached for the provider:
-- what it can have counted): with `before` (refused_at), by the refused call's start.
local function limit_kind(m, now, remaining_tokens, remaining_requests, before)
  local n, sum, sent = inflight_stats(m, nil, before)
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

-- Requests spent in the first bucket, with `left` after our calls on their way
-- (nil: not sent), `unstarted` of them admitted and not started: a provider that
-- states no request limit (hrpm) shows its rate (first_bucket_rate, of the calls
-- started and those), and an RPM above 10/9 of it is lowered to it before that
-- 429, once (balancer.admission.shown.spent_early). The count may be as old as
-- the call that carried it (`counted_at`: its start): its rate is read as of then,
-- or a right quota's burst, spent at its own rate, reads as a lower one.
local function learn_from_spent(m, now, left, unstarted, counted_at)
  if m.learn ~= 1 or left == nil or left > 0 or m.hrpm > 0 or m.lrpm > 0 or eff_rpm(m) == 0 then return end
  local shown = first_bucket_rate(m.rpm, m.rburst, m.first_calls + unstarted, math.max(0, (counted_at or now) - m.first_at))
  if shown <= 0 or shown * 10 >= eff_rpm(m) * 9 then return end
  m.prpm, m.lrpm, m.lowered_at = shown, shown, now
end

-- A learned limit at `level` after a raise of it drew a 429 (balancer.admission.learned.undone):
-- concurrency one step down (refused at once: the level before held), tokens and
-- requests two (a bucket hides a small overshoot for longer than a window).
local function undone(level, peak, kind)
  local steps = 2
  if kind == 'CONCURRENCY' then steps = 1 end
  return math.max(1, level - steps * step_of(peak))
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
-- of the started calls in flight, if any and fewer; tokens and requests: of our
-- recent rate, if lower), at least 1, and remembers that level (the raises' step).
-- Within FIRST_BUCKETS bucket times tokens or requests go to 7/10 of the rate it
-- shows (first_bucket_rate), once (see lowered). A 429
-- within a window of a raise says the raise went too far: a kind it raised
-- goes back (undone: one step for concurrency, two for tokens or requests), not to 7/10, and
-- the next raise waits twice as long (up to MAX_WINDOW_MS). Every other 429 for concurrency
-- says the started calls in flight were at least one too many: the cap goes
-- no higher than that, less one, and its peak no higher than that (the 429
-- that started the pause may be for a call started after this one). A kind whose limit the provider states
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
    if kind == 'CONCURRENCY' and m.lcap > 0 and sent > m.lcap and sent < m.pcap then m.pcap = sent end
    return
  end
  local w = window_ms(m)
  local probed = m.raised_at > m.lowered_at and now - m.raised_at < w
  if probed then m.window = math.min(w * 2, MAX_WINDOW_MS) end
  local t = now - m.first_at
  if kind == 'TOKENS' and probed and m.ltpm > 0 then
    m.ltpm = undone(m.ltpm, m.ptpm, kind)
  elseif kind == 'TOKENS' then
    local from, to = lowered(eff_tpm(m), first_bucket_rate(m.tpm, m.burst, m.first_tokens, t),
      recent_rate(m, now, true))
    if from then m.ptpm, m.ltpm = from, to end
  elseif kind == 'REQUESTS' and probed and m.lrpm > 0 then
    m.lrpm = undone(m.lrpm, m.prpm, kind)
  elseif kind == 'REQUESTS' then
    if eff_rpm(m) == 0 then return end
    local from, to = lowered(eff_rpm(m), first_bucket_rate(m.rpm, m.rburst, m.first_calls, t),
      recent_rate(m, now, false))
    if from then m.prpm, m.lrpm = from, to end
  elseif probed and m.lcap > 0 then
    m.lcap = undone(m.lcap, m.pcap, kind)
  else
    m.pcap = eff_cap(m)
    if sent > 0 then m.pcap = math.min(m.pcap, sent) end
    m.lcap = math.max(1, math.floor(m.pcap * 7 / 10))
  end
  m.lowered_at = now
end

-- admit.lua: admit a batch of candidates in one atomic step (WDRR + buckets + slots).
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] lease length in ms
-- ARGV[3] base quantum in tokens (a model's quantum is weight * base quantum)
-- ARGV[4] '1': only models a worker consumes (a live record, consumed() in
--         state.lua) may admit: the dispatcher's batches; '' (the router's
--         callers, outside Celery): any model
-- ARGV[5] number of candidates N, then N triples:
--         estimated tokens, allowed models ('' = any, else comma-separated names),
--         model to avoid ('' = none: else a model whose call for it just failed;
--         it is passed over when another model is eligible)
-- Returns {'NOSTATE'} if the live state is missing, else 3 strings per candidate:
--   'A', model, admission id        admitted
--   'W', retry_at_ms or '', now_ms  not now ('' = no known time: models disabled)
--   'R', 'unknown' | 'toolarge', largest burst or ''   never admissible
-- The rules are documented, step for step, in balancer/admission/reference/__init__.py.

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local lease_ms, quantum, n = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local need_consumer = ARGV[4] == '1'

local names = redis.call('ZRANGE', MODELS, 0, -1)
local models = {}
local serves = {}  -- a model may take a call: consumed by a worker, or no consumer needed
for _, name in ipairs(names) do
  local m = load_model(name)
  refill(m, now)
  purge(m, now)
  models[name] = m
  serves[name] = (not need_consumer) or consumed(name, now)
end
local meta = redis.call('HMGET', META, 'epoch', 'seq', 'rr')
local epoch, seq, rr = meta[1], tonumber(meta[2]), meta[3] or ''

local held = {}
local out = {}
for c = 0, n - 1 do
  local est, spec, avoid = tonumber(ARGV[6 + 3 * c]), ARGV[7 + 3 * c], ARGV[8 + 3 * c]
  local allowed = nil
  if spec ~= '' then
    allowed = {}
    for part in string.gmatch(spec, '[^,]+') do allowed[part] = true end
  end
  local pool = {}
  for _, name in ipairs(names) do
    if allowed == nil or allowed[name] then pool[#pool + 1] = models[name] end
  end
  local largest = 0
  for _, m in ipairs(pool) do largest = math.max(largest, m.burst) end
  if #pool == 0 then
    out[#out + 1] = 'R'; out[#out + 1] = 'unknown'; out[#out + 1] = ''
  elseif est > largest then
    out[#out + 1] = 'R'; out[#out + 1] = 'toolarge'; out[#out + 1] = fmt(largest)
  else
    local fits, eligible, is_eligible = {}, {}, {}
    for _, m in ipairs(pool) do
      if m.enabled == 1 and est <= m.burst and serves[m.name] then
        fits[#fits + 1] = m
        if not held[m.name] and has_capacity(m, est, now) then
          eligible[#eligible + 1] = m
          is_eligible[m.name] = true
        end
      end
    end
    -- Retry placement: after a transient failure on a model, another eligible model goes first.
    if avoid ~= '' and is_eligible[avoid] and #eligible > 1 then
      local others = {}
      for _, m in ipairs(eligible) do
        if m.name ~= avoid then others[#others + 1] = m end
      end
      eligible = others
      is_eligible[avoid] = nil
    end
    if #fits == 0 then
      out[#out + 1] = 'W'; out[#out + 1] = ''; out[#out + 1] = fmt(now)
    elseif #eligible == 0 then
      local earliest, starved, starved_at = nil, nil, nil
      for _, m in ipairs(fits) do
        local at = now + wait_ms(m, est, now)
        if earliest == nil or at < earliest then earliest = at end
        local short = m.tokens < tokens_needed(m, est) or window_short(m, est)
        if not held[m.name] and short and (starved_at == nil or at < starved_at) then
          starved, starved_at = m.name, at
        end
      end
      if starved then held[starved] = true end
      out[#out + 1] = 'W'; out[#out + 1] = fmt(earliest); out[#out + 1] = fmt(now)
    else
      -- WDRR: add the fewest whole quanta that let one eligible model cover est.
      local covered = false
      for _, m in ipairs(eligible) do
        if m.deficit >= est then covered = true end
      end
      if not covered then
        local rounds = nil
        for _, m in ipairs(eligible) do
          local r = math.ceil((est - m.deficit) / (m.weight * quantum))
          if rounds == nil or r < rounds then rounds = r end
        end
        for _, m in ipairs(eligible) do
          m.deficit = math.min(m.deficit + rounds * m.weight * quantum, m.burst)
        end
      end
      local start = 1
      for i, name in ipairs(names) do
        if name == rr then start = i + 1 end
      end
      local chosen = nil
      for k = 0, #names - 1 do
        local name = names[((start - 1 + k) % #names) + 1]
        if is_eligible[name] and models[name].deficit >= est then
          chosen = models[name]
          break
        end
      end
      chosen.deficit = chosen.deficit - est
      charge(chosen, est, now)
      seq = seq + 1
      local lid = epoch .. '-' .. fmt(seq)
      put_lease(lid, chosen, est, now + lease_ms, 0)
      measure_refill(chosen.name, now)
      rr = chosen.name
      out[#out + 1] = 'A'; out[#out + 1] = chosen.name; out[#out + 1] = lid
    end
  end
end

for _, name in ipairs(names) do save_model(models[name]) end
redis.call('HSET', META, 'seq', fmt(seq), 'rr', rr)
local kinds = {A = 0, W = 0, R = 0}
for i = 1, #out, 3 do kinds[out[i]] = kinds[out[i]] + 1 end
count_system('admitted', kinds.A)
count_system('not_now', kinds.W)
count_system('rejected', kinds.R)
count_system('dispatch_rounds', 1)
return out

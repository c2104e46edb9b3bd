-- window.lua: the window cap (after state.lua, before limits.lua, which checks and charges
-- it): a quota with window_cap = 1 admits, in any WINDOW_MS, at most its TPM tokens and
-- (with an RPM) its RPM calls. The rules are balancer/admission/window.py's, step for step.
-- <tag>:window:<name>  list  'admitted_ms:tokens' per admission of the last WINDOW_MS, oldest
-- first; the model's wtokens and wcalls are its sums. It exists only while the cap is on.
-- (WINDOW_MS comes from window.py's prelude, WINDOW_INFIX from keys.py's.)

local function window_key(name) return PREFIX .. WINDOW_INFIX .. name end

local function window_entry(text)
  local at, est = string.match(text, '^(%d+):(%d+)$')
  return tonumber(at), tonumber(est)
end

-- Entries WINDOW_MS old leave the head (window.expired_count); the sums follow.
local function window_expire(m, now)
  if m.window_cap ~= 1 or m.wcalls == 0 then return end
  local key = window_key(m.name)
  while true do
    local head = redis.call('LINDEX', key, 0)
    if not head then break end
    local at, est = window_entry(head)
    if at > now - WINDOW_MS then break end
    redis.call('LPOP', key)
    m.wtokens, m.wcalls = m.wtokens - est, m.wcalls - 1
  end
end

-- One more admission of est fits the window (window.fits).
local function window_fits(m, tokens, calls, est)
  if m.window_cap ~= 1 then return true end
  return tokens + est <= m.tpm and (m.rpm == 0 or calls + 1 <= m.rpm)
end

-- The window lacks the tokens for est (window.tokens_short).
local function window_short(m, est) return m.window_cap == 1 and m.wtokens + est > m.tpm end

-- ms until the window has room for est (window.wait_ms).
local function window_wait(m, est, now)
  if window_fits(m, m.wtokens, m.wcalls, est) then return 0 end
  local tokens, calls, latest = m.wtokens, m.wcalls, now - WINDOW_MS
  for _, text in ipairs(redis.call('LRANGE', window_key(m.name), 0, -1)) do
    local at, tok = window_entry(text)
    tokens, calls, latest = tokens - tok, calls - 1, math.max(latest, at)
    if window_fits(m, tokens, calls, est) then return math.max(0, latest + WINDOW_MS - now) end
  end
  return 0
end

-- An admission of est at now enters the window.
local function window_add(m, est, now)
  if m.window_cap ~= 1 then return end
  redis.call('RPUSH', window_key(m.name), fmt(now) .. ':' .. fmt(est))
  m.wtokens, m.wcalls = m.wtokens + est, m.wcalls + 1
end

-- The cap set off (or the model created, removed, restored): no window, sums at 0.
local function window_clear(m)
  redis.call('DEL', window_key(m.name))
  m.wtokens, m.wcalls = 0, 0
end

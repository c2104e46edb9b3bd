-- ready.lua: the ready lists (after signals.lua): a busy model's next calls,
-- taken by the call that frees a slot.

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
      charge(m, r.e, now)
      put_lease(r.lid, m, r.e, now + lease_ms, started)
      taken[#taken + 1] = r
    else
      break
    end
  end
end

-- take_ready.lua: the dispatcher's pass over every model's ready list: drop
-- what can no longer be taken, and admit what free slots can take now.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] lease length in ms
-- ARGV[3] '1': a model no worker consumes (consumed() in state.lua) takes
--         nothing, and its whole list is dropped at once
-- Returns {'NOSTATE'} if the live state is missing, else 5 strings per entry:
--   'T', model, task id, admission id, estimated tokens   taken: admitted, the
--        lease not started (the worker renews it, as after admit.lua)
--   'D', model, task id, admission id, estimated tokens   dropped: expired, or
--        its model is disabled, or not consumed, or its burst too small for it
--        (back to pending)
-- Only models with a non-empty ready list are visited (refilled, purged, saved).

if not loaded() then return {'NOSTATE'} end
local now = clock(ARGV[1])
local lease_ms = tonumber(ARGV[2])
local out = {}
for _, name in ipairs(redis.call('ZRANGE', MODELS, 0, -1)) do
  if redis.call('LLEN', ready_key(name)) > 0 then
    local m = load_model(name)
    refill(m, now)
    purge(m, now)
    local taken, dropped = {}, {}
    if ARGV[3] == '1' and not consumed(name, now) then
      for _, raw in ipairs(redis.call('LRANGE', ready_key(name), 0, -1)) do dropped[#dropped + 1] = parse_ready(raw) end
      redis.call('DEL', ready_key(name))
    else
      take_ready(m, now, lease_ms, 0, math.huge, true, taken, dropped)
    end
    count_system('admitted', #taken)  -- each take is an admission, as admit.lua's
    for _, r in ipairs(taken) do
      measure_refill(name, now)
      out[#out + 1] = 'T'; out[#out + 1] = name; out[#out + 1] = r.task; out[#out + 1] = r.lid; out[#out + 1] = fmt(r.e)
    end
    for _, r in ipairs(dropped) do
      out[#out + 1] = 'D'; out[#out + 1] = name; out[#out + 1] = r.task; out[#out + 1] = r.lid; out[#out + 1] = fmt(r.e)
    end
    save_model(m)
  end
end
return out

-- trip.lua: a call on a model failed transiently (5xx, timeout, refused
-- connection): count it toward the model's circuit breaker.
-- KEYS[1] <tag>:meta, KEYS[2] <tag>:models, KEYS[3] <tag>:leases (see state.lua)
-- ARGV[1] now in ms, or '' for Redis TIME
-- ARGV[2] model
-- The circuit opens after CIRCUIT_FAILURES consecutive transient failures (an
-- answered call resets the count, in finish.lua): the model is paused for
-- CIRCUIT_BASE_MS, then probed one call at a time (slot_cap in limits.lua). A probe
-- that fails pauses it again, twice as long, up to CIRCUIT_MAX_MS; one answered
-- call closes the circuit. Failures while the circuit is open, or that open
-- it, are the backend's, not the task's: they do not use up the task's attempts.
-- A failure during a running pause (calls that were in flight when it opened)
-- does not lengthen it.
-- Failures in a row on every model, with no call answered anywhere between (finish.lua
-- resets the count), are the Models Backend's as a whole: from the CIRCUIT_FAILURES-th on,
-- none counts against a task either. (Each model's first failures before its own circuit
-- opened used an attempt; under load a flexible task met them on five models in one outage.)
-- Returns {counted, opened}: counted 1 if the failure counts against the task's
-- attempts; opened 1 if this failure opened the circuit or paused it again.

local CIRCUIT_FAILURES, CIRCUIT_BASE_MS, CIRCUIT_MAX_MS = 3, 2000, 30000
local m = load_model(ARGV[2])
if not m then return {1, 0} end
local now = clock(ARGV[1])
refill(m, now)
local backend_fails = redis.call('HINCRBY', META, 'bfails', 1)
local counted, opened = 0, 0
if m.probing == 1 then
  if m.paused <= now then
    m.backoff = math.min(m.backoff * 2, CIRCUIT_MAX_MS)
    m.paused = now + m.backoff
    opened = 1
  end
else
  m.fails = m.fails + 1
  if m.fails >= CIRCUIT_FAILURES then
    m.fails, m.probing, m.backoff = 0, 1, CIRCUIT_BASE_MS
    m.paused = math.max(m.paused, now + CIRCUIT_BASE_MS)
    opened = 1
  elseif backend_fails < CIRCUIT_FAILURES then
    counted = 1
  end
end
save_model(m)
count(ARGV[2], 'transient', 1)
return {counted, opened}

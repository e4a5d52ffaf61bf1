-- inspect_job.lua: one job's state (read only).
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id
-- Returns: {status "r" admitted | "w" parked | "" unknown, held keys {key, ...},
--           parked key or "", position (1-based, 0 if not parked), lease expiry (ms, -1 if none),
--           priority, data}
local job = ARGV[1]
local raw = call('HGET', K_STATE, '\2' .. job)
if not raw then return {'', {}, '', 0, -1, 0, ''} end
local spec = parse(raw)
local lease_ms = tonumber(call('ZSCORE', K_LEASES, job))
if lease_ms then return {'r', spec.k, '', 0, lease_ms, prio(spec), spec.d} end
local held = {}
for i = 1, spec.n - 1 do held[i] = spec.k[i] end
local key = spec.k[spec.n]
return {'w', held, key, position(key, raw), -1, prio(spec), spec.d}

-- reclaim_leases.lua: release jobs whose lease ran out (their worker died or hung).
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: max jobs to reclaim in this call (int >= 1)
-- Does: release up to max jobs with lease <= now (Redis TIME, ms), earliest first,
-- handing their slots on.
-- Returns: {reclaimed {job_id, data, ...}, woken {job_id, data, ...}}
local now = now_ms()
local woken, reclaimed = {}, {}
reclaim(now, tonumber(ARGV[1]), woken, reclaimed)
return {reclaimed, woken}

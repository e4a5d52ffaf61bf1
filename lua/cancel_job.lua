-- cancel_job.lua: withdraw a parked job (not a running one); the keys it held while
-- parked are handed on to their waiters.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id
-- Does: if the job is parked (has no lease), drop it like release_job; then reclaim up to
-- 8 expired leases.
-- Returns: {cancelled 1|0, woken {job_id, data, ...}, reclaimed {job_id, data, ...}}
local job = ARGV[1]
local now = now_ms()
local woken, reclaimed = {}, {}
local cancelled = 0
local raw = call('HGET', K_JOBS, job)
if raw and not call('ZSCORE', K_LEASES, job) then
  drop(job, parse(raw), now, woken, false)
  cancelled = 1
end
reclaim(now, 8, woken, reclaimed)
return {cancelled, woken, reclaimed}

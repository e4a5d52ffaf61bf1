-- cancel_job.lua: withdraw a parked job (not a running one); the keys it held while
-- parked are handed on to their waiters.
-- KEYS: the 8 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id
-- Does: if the job is parked ("w"), drop it like release_job; then reclaim up to 8
-- expired leases.
-- Returns: {cancelled 1|0, woken {job_id, data, ...}, reclaimed {job_id, data, ...}}
local job = ARGV[1]
local now = now_ms()
local woken, reclaimed = {}, {}
local cancelled = 0
local raw = call('HGET', K_JOBS, job)
if raw then
  local spec = parse(raw)
  if spec.st == 'w' then
    drop(job, spec, now, woken)
    cancelled = 1
  end
end
reclaim(now, 8, woken, reclaimed)
return {cancelled, woken, reclaimed}

-- cancel_job.lua: withdraw a parked job (not a running one); the keys it held while
-- parked are handed on to their waiters.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id
-- Does: if the job is parked (has no lease), drop it like release_job; then reclaim up to
-- RECLAIM_BATCH (_lib.lua) expired leases.
-- Returns: like release_job: cancelled 1|0, "job_id\0data" (one job woken), or
--          {cancelled 1|0, #woken, woken job_id, data ..., reclaimed job_id, data ...}
local job = ARGV[1]
clock()
local r = call('HMGET', K_STATE, '\2' .. job, DUE)
read_due(r[2])
local cancelled = 0
if r[1] and not call('ZSCORE', K_LEASES, job) then
  drop(job, r[1], parse(r[1]).k, 0, W, false, nil, 0)
  cancelled = 1
end
reclaim_due(RECLAIM_BATCH, W, R)
return done(cancelled)

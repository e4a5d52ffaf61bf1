-- release_job.lua: a job is done (or gives up): free every key it holds and hand each
-- freed slot to that key's head waiter in the same call.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id
-- Does: drop the job (spec, lease or wait entry), handing on each freed key in canonical
-- order; then reclaim up to 8 expired leases.
-- Returns: {found 1|0, woken {job_id, data, ...}, reclaimed {job_id, data, ...}}
local job = ARGV[1]
local now = now_ms()
local woken, reclaimed = {}, {}
local found = 0
local raw = call('HGET', K_JOBS, job)
if raw then
  drop(job, parse(raw), now, woken, nil)
  found = 1
end
reclaim(now, 8, woken, reclaimed)
return {found, woken, reclaimed}

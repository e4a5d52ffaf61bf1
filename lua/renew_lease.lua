-- renew_lease.lua: heartbeat of a running job.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id, lease (ms, > 0)
-- Does: if the job is admitted and its lease has not run out yet, set its lease to
-- now + lease (lowering "\1due" if the new expiry is the earliest). A job whose lease ran
-- out is not revived (it awaits reclaim and re-delivery), so the worker learns its hold is
-- gone.
-- Returns: 1 renewed, 0 unknown / parked / expired
local job = ARGV[1]
local exp = num(call('ZSCORE', K_LEASES, job))
if not exp then return 0 end
clock()
if exp <= now then return 0 end
local e = now + ARGV[2]
local es = fmt('%d', e)
call('ZADD', K_LEASES, es, job)
if e < exp then
  local d = num(call('HGET', K_STATE, DUE))
  if not d or e < d then call('HSET', K_STATE, DUE, es) end
end
return 1

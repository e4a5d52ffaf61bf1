-- renew_lease.lua: heartbeat of a running job.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id, lease (ms, > 0)
-- Does: if the job is admitted ("r") and its lease has not run out yet, set its lease
-- to now + lease. A job whose lease ran out is not revived (it awaits reclaim and
-- re-delivery), so the worker learns its hold is gone.
-- Returns: 1 renewed, 0 unknown / parked / expired
local job = ARGV[1]
local exp = tonumber(call('ZSCORE', K_LEASES, job))
if not exp then return 0 end
local now = now_ms()
if exp <= now then return 0 end
call('ZADD', K_LEASES, now + tonumber(ARGV[2]), job)
return 1

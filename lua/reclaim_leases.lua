-- reclaim_leases.lua: release jobs whose lease ran out (their worker died or hung).
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: max jobs to reclaim in this call (int >= 1)
-- Does: release up to max jobs with lease <= now (Redis server time, ms), earliest first,
-- handing their slots on. Unlike the inline reclaim of the other operations it looks at
-- the leases themselves whatever "\1due" says, and stores the true earliest expiry: the
-- sweep is the backstop that would also repair a wrong hint.
-- Returns: {#reclaimed, reclaimed job_id, data ..., woken job_id, data ...}
clock()
read_due(call('HGET', K_STATE, DUE))
reclaim(tonumber(ARGV[1]), W, R)
return reply({}, R, W)

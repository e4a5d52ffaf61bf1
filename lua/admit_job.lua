-- admit_job.lua: admit a job on its keys, or park it on the first full one.
-- KEYS: the 8 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id, priority (int 0..250, higher first), lease (ms, > 0), data (opaque string),
--       then key, limit pairs with keys sorted (canonical order), limits ints >= 0.
-- Does, atomically: reclaim up to 8 expired leases; if job_id is known, nothing more
-- (idempotent re-delivery: its current state is returned); else store each limit and hand
-- on where a raised limit made room (before the newcomer competes: no barging); then take
-- the keys in order, parking on the first full one.
-- Returns: {admitted 1|0, parked key or "", position (1-based, 0 if admitted),
--           woken {job_id, data, ...}, reclaimed {job_id, data, ...}, duplicate 1|0}
local job = ARGV[1]
local now = now_ms()
local woken, reclaimed = {}, {}
reclaim(now, 8, woken, reclaimed)
local raw = call('HGET', K_JOBS, job)
if raw then
  if sub(raw, 1, 1) == 'r' then return {1, '', 0, woken, reclaimed, 1} end
  local spec = parse(raw)
  local key = spec.k[spec.n]
  return {0, key, position(key, spec, job), woken, reclaimed, 1}
end
local keys, lims = store_limits(5, now, woken)
local ls, data = ARGV[3], ARGV[4]
local spec = {
  st = 'w', n = 1, ip = fmt('%02x', 255 - tonumber(ARGV[2])), q = NOSEQ, k = keys, ls = tonumber(ls), d = data,
  tail = ls .. '\0' .. table.concat(keys, '\0') .. '\1' .. data,
}
if grant(job, spec, now, lims) then return {1, '', 0, woken, reclaimed, 0} end
local key = keys[spec.n]
return {0, key, position(key, spec, job), woken, reclaimed, 0}

-- admit_job.lua: admit a job on its keys, or park it on the first full one.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id, priority (int 0..250, higher first), lease (ms, > 0), data (opaque string),
--       require_ready (1|0), then key, limit pairs with keys sorted (canonical order),
--       limits ints >= 0.
-- Does, atomically: reclaim up to 8 expired leases; if job_id is known, nothing more
-- (idempotent re-delivery: its current state is returned); else store each limit and hand
-- on where a raised limit made room (before the newcomer competes: no barging); then take
-- the keys in order, parking on the first full one.
-- Returns: {admitted 1|0, parked key or "", position (1-based, 0 if admitted),
--           woken {job_id, data, ...}, reclaimed {job_id, data, ...}, duplicate 1|0,
--           not_ready 1|0}
-- With require_ready=1 on a tag that init_tag has not marked ready (its state was lost and
-- is not rebuilt yet), nothing is stored: {0, '', 0, woken, reclaimed, 0, 1}.
-- Common path (all keys free, limits unchanged): TIME, ZCOUNT, HSETNX, HMGET, HSET, ZADD.
local job = ARGV[1]
local now = now_ms()
local woken, reclaimed = {}, {}
reclaim(now, 8, woken, reclaimed)
local nk = (#ARGV - 5) / 2
local keys, fields = {}, {}
for i = 1, nk do
  local key = ARGV[4 + 2 * i]
  keys[i] = key
  fields[2 * i - 1] = key
  fields[2 * i] = '\0' .. key
end
local ls, data = ARGV[3], ARGV[4]
local spec = {
  n = nk + 1, ip = fmt('%02x', 255 - tonumber(ARGV[2])), q = NOSEQ, k = keys, ls = tonumber(ls), d = data,
  tail = ls .. '\0' .. table.concat(keys, '\0') .. '\1' .. data,
}
-- The duplicate check and the spec write in one command (the spec is rewritten if it parks).
if call('HSETNX', K_JOBS, job, char(nk + 1) .. spec.ip .. NOSEQ .. spec.tail) == 0 then
  local known = parse(call('HGET', K_JOBS, job))
  if call('ZSCORE', K_LEASES, job) then return {1, '', 0, woken, reclaimed, 1, 0} end
  local key = known.k[known.n]
  return {0, key, position(key, known, job), woken, reclaimed, 1, 0}
end
local guarded = ARGV[5] == '1'
if guarded then fields[#fields + 1] = READY end
local r = call('HMGET', K_COUNTS, unpack(fields))
if guarded and not r[#r] then
  call('HDEL', K_JOBS, job)
  return {0, '', 0, woken, reclaimed, 0, 1}
end
local old, cnt = {}, {}
for i = 1, nk do
  old[i] = r[2 * i]
  cnt[i] = r[2 * i - 1]
end
if store_limits(6, old, now, woken) then
  cnt = call('HMGET', K_COUNTS, unpack(keys)) -- a raise handed slots on: counts moved
end
-- Take the keys in order while they have room (count < limit), one HSET for all counts.
local set = {}
local n = 1
while n <= nk do
  local c = tonumber(cnt[n]) or 0
  if c >= tonumber(ARGV[5 + 2 * n]) then break end
  set[#set + 1] = keys[n]
  set[#set + 1] = c + 1
  n = n + 1
end
if #set > 0 then call('HSET', K_COUNTS, unpack(set)) end
if n > nk then
  call('ZADD', K_LEASES, now + spec.ls, job)
  return {1, '', 0, woken, reclaimed, 0, 0}
end
park(job, spec, n)
local key = keys[n]
return {0, key, position(key, spec, job), woken, reclaimed, 0, 0}

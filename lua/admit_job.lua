-- admit_job.lua: admit a job on its keys, or park it on the first full one.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id, priority (int 0..250, higher first), lease (ms > 0, 10 digits zero-padded:
--       the spec stores it at a fixed place), data (opaque string),
--       require_ready (1|0), flows ("" when every key has the default flow "" at weight 1
--       and no key a reserve or guard, otherwise flow "\1" cost, then "\1" guard index "\1"
--       guarantee for a key with a guard, per key joined by "\0" in key order: see
--       key_arg), then key, limit pairs with keys sorted (canonical order), limits ints >= 0,
--       written "L:R" for a key with a reserve R (0 < R <= L; only with flows not "").
-- Does, atomically: reclaim up to RECLAIM_BATCH (_lib.lua) expired leases; if job_id is known, nothing more
-- (idempotent re-delivery: its current state is returned); else store each changed limit
-- and hand on where a raised limit made room (before the newcomer competes: no barging);
-- then take the keys in order, parking on the first full one (a key with a reserve is full
-- at limit - reserve, unless the job is within its guarantee there: docs/engine.md,
-- "Reserves and guarantees"; it then parks in the key's floor band). An idle key has no stored
-- limit: this job's is stored with the grant (in the same HSET) for the keys it takes or
-- parks on; a job parked before its last key also stores the limits it passed ("\3"..job),
-- to bring to later keys that may be idle by the time it gets there, with its flows.
-- Parking computes the job's fair order (fair_order, _lib.lua): that read (the flow's
-- records, and the key's head at its priority when the flow starts to wait) is only paid
-- by a job that parks.
-- Returns: 1 when admitted with nothing else to report; otherwise
--          {admitted 1|0, parked key or "", position (1-based, 0 if admitted), duplicate 1|0,
--           not_ready 1|0, #woken, woken job_id, data ..., reclaimed job_id, data ...}
-- With require_ready=1 on a tag that init_tag has not marked ready (its state was lost and
-- is not rebuilt yet), nothing is stored for the job, known or not (the check comes before
-- the re-delivery lookup, after the inline reclaim): {0, '', 0, 0, 1, ...}.
-- Common path (all keys free, limits unchanged, no lease due): PTTL (the clock), HMGET,
-- HSET, ZADD.
local job = ARGV[1]
clock()
local nk = (#ARGV - 6) / 2
local jf = '\2' .. job
local f_job = 2 * nk + 1
local r = admit_read(ARGV, nk, jf)
read_due(r[f_job + 1])
if reclaim_due(RECLAIM_BATCH, W, R) then r = admit_read(ARGV, nk, jf) end
if ARGV[5] == '1' and not r[f_job + 3] then return reply({0, '', 0, 0, 1}, W, R) end
local known = r[f_job]
if known then -- idempotent re-delivery: report where the job is
  if call('ZSCORE', K_LEASES, job) then return reply({1, '', 0, 1, 0}, W, R) end
  local spec = parse(known)
  local key = spec.k[spec.n]
  return reply({0, key, position(key, known), 1, 0}, W, R)
end
-- Limits: the common case is "unchanged" (string compare, nothing written). A stored limit
-- that differs is stored now (and a raise hands on); a missing one (an idle key) with the
-- grant below.
local changed = false
for i = 1, nk do
  local stored = r[2 * i]
  if stored and stored ~= ARGV[6 + 2 * i] then changed = true end
end
local r0 = r
if changed then
  local old = {}
  for i = 1, nk do old[i] = r[2 * i] or ARGV[6 + 2 * i] end -- missing: not stored here
  if store_limits(ARGV, 7, old, W) then r = admit_read(ARGV, nk, jf) end
end
-- Count the keys that have room, in order: count < limit - reserve, or count < limit for a
-- job within its guarantee there. A key's limit now is the one passed (stored, or about to
-- be), unless the key was idle and a job woken just above took it with its own (which may
-- carry a reserve). With flows "" no limit passed has a reserve and the job no guard.
local fa = ARGV[6]
local n = 1
if fa == '' then
  while n <= nk do
    local s = not r0[2 * n] and r[2 * n]
    if (num(r[2 * n - 1]) or 0) >= (s and open_slots(s) or num(ARGV[6 + 2 * n])) then break end
    n = n + 1
  end
else
  while n <= nk do
    local c = num(r[2 * n - 1]) or 0
    local l, rv = lr((not r0[2 * n] and r[2 * n]) or ARGV[6 + 2 * n])
    if c >= l - rv then -- full unless within its guarantee: read the guard only then
      if c >= l then break end
      local _, _, g, q = key_arg(fa, n)
      if not admit_within(r, g, q) then break end
    end
    n = n + 1
  end
end
local ls = ARGV[3]
local tail
if nk == 1 then
  tail = ls .. ARGV[7] .. '\1' .. ARGV[4]
else
  local names = {}
  for i = 1, nk do names[i] = ARGV[5 + 2 * i] end
  tail = ls .. table.concat(names, '\0') .. '\1' .. ARGV[4]
end
if n > nk then -- admitted: one HSET for the counts, the spec and perhaps "\1due"
  local e = now + lease_ms(ls)
  local es = fmt('%d', e)
  local raw = spec_raw(nk + 1, nk, ip_of(ARGV[2]), NOSEQ, tail)
  local lower = not due or e < due
  if nk == 1 and r[2] then
    if lower then
      call('HSET', K_STATE, ARGV[7], int((num(r[1]) or 0) + 1), jf, raw, DUE, es)
    else
      call('HSET', K_STATE, ARGV[7], int((num(r[1]) or 0) + 1), jf, raw)
    end
  else
    local set = {}
    for i = 1, nk do
      local key = ARGV[5 + 2 * i]
      set[#set + 1] = key
      set[#set + 1] = int((num(r[2 * i - 1]) or 0) + 1)
      if not r[2 * i] then -- an idle key: its limit is now this job's
        set[#set + 1] = '\0' .. key
        set[#set + 1] = ARGV[6 + 2 * i]
      end
    end
    set[#set + 1], set[#set + 2] = jf, raw
    if lower then set[#set + 1], set[#set + 2] = DUE, es end
    call('HSET', K_STATE, unpack_(set))
  end
  call('ZADD', K_LEASES, es, job)
  if #W == 0 and #R == 0 then return 1 end
  return reply({1, '', 0, 0, 0}, W, R)
end
-- Parked on key n (in its floor band when within its guarantee there): its fair order
-- (which reads the flow's records), then counts of keys 1..n-1, the flow's records, the
-- spec and the arrival counter in one HSET.
local seq = (num(r[f_job + 2]) or 0) + 1
local key = ARGV[5 + 2 * n]
local ip = ip_of(ARGV[2])
local set = {}
local flow, cost, g, q = key_arg(fa, n)
if g > 0 and admit_within(r, g, q) then ip = floor_ip(ip) end
local q, fc = fair_order(key, ip, flow, cost, fmt('%012x', seq), set)
local raw = spec_raw(n, nk, ip, q, tail)
for i = 1, n do
  local k = ARGV[5 + 2 * i]
  if i < n then
    set[#set + 1] = k
    set[#set + 1] = int((num(r[2 * i - 1]) or 0) + 1)
  end
  if not r[2 * i] then -- an idle key (or a new one): its limit is now this job's
    set[#set + 1] = '\0' .. k
    set[#set + 1] = ARGV[6 + 2 * i]
  end
end
if n < nk then -- it will go on to later keys: keep the limits (and flows, guards) it passed
  local lims = {}
  for i = 1, nk do lims[i] = ARGV[6 + 2 * i] end
  local rec = table.concat(lims, '\0')
  if ARGV[6] ~= '' then rec = rec .. '\2' .. ARGV[6] end
  set[#set + 1], set[#set + 2] = '\3' .. job, rec
end
set[#set + 1], set[#set + 2] = jf, raw
set[#set + 1], set[#set + 2] = SEQ, fmt('%d', seq)
call('HSET', K_STATE, unpack_(set))
call('ZADD', K_WAITS, 0, wait_entry(key, raw, job, fc))
return reply({0, key, position(key, raw), 0, 0}, W, R)

-- check_invariants.lua: consistency audit for tests and operators. O(state): never on a
-- hot path.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: none
-- Checks: each key's count equals the holders its jobs' specs imply (an admitted job,
-- i.e. one with a lease, holds all its keys; a parked one keys 1..n-1 and has its wait
-- entry, which carries its current spec); every wait entry belongs to a parked job; no
-- key with waiters has room for them (count < limit - reserve), nor one with waiters of
-- the floor band room at all (count < limit); a stored reserve is within 1..limit; wait
-- entries' priority bytes are two hex digits or two of the floor band; every key with
-- holders or waiters has a limit; every lease and every limits record ("\3"..job) belongs to a job, and a job
-- parked before its last key has its record; "\1due" is at
-- most the earliest lease expiry (and present whenever a lease is). Fair order: each flow
-- with waiters on a key at a priority has both records ("\4", "\5"), and only such flows
-- do; the count is its number of wait entries, every entry carries the backlog start of
-- the record, the finish tag is at least every entry's tag, and the flow's entries are
-- in arrival order (FIFO within a flow).
-- Returns: {problem description, ...} (empty when consistent)
local problems = {}
local function bad(msg) problems[#problems + 1] = msg end
local admitted = {}
local leases = call('ZRANGE', K_LEASES, 0, -1, 'WITHSCORES')
local earliest
for i = 1, #leases, 2 do
  admitted[leases[i]] = true
  local e = tonumber(leases[i + 1])
  if not earliest or e < earliest then earliest = e end
end
local fields = call('HGETALL', K_STATE)
local specs, counts, limits, reserves, meta, records, finish, fcount = {}, {}, {}, {}, {}, {}, {}, {}
for i = 1, #fields, 2 do
  local f, v = fields[i], fields[i + 1]
  local b = byte(f, 1)
  if (b == 4 or b == 5) and find(f, '\1', 2, true) then -- a flow record (key names hold no \1)
    if b == 4 then finish[sub(f, 2)] = v else fcount[sub(f, 2)] = tonumber(v) end
  elseif b == 0 then
    local x = find(v, ':', 1, true)
    local l, rv = tonumber(x and sub(v, 1, x - 1) or v), x and tonumber(sub(v, x + 1)) or 0
    if not l or not rv or (x and (rv < 1 or rv > l)) then bad('malformed limit ' .. f .. ' = ' .. v) end
    limits[sub(f, 2)], reserves[sub(f, 2)] = l, rv
  elseif b == 1 then
    meta[f] = v
  elseif b == 2 then
    specs[sub(f, 2)] = v
  elseif b == 3 then
    records[sub(f, 2)] = v
  else
    counts[f] = tonumber(v)
    if tonumber(v) <= 0 then bad('non-positive count on ' .. f) end
  end
end
local holders, members = {}, {}
for job, raw in pairs(specs) do
  local spec = parse(raw)
  local held = #spec.k
  if spec.nk ~= #spec.k then bad('key count byte mismatch ' .. job) end
  if not admitted[job] then
    held = spec.n - 1
    if spec.n > #spec.k then
      bad('parked job past its last key ' .. job)
    else
      if spec.n < #spec.k and not records[job] then bad('parked job without its limits record ' .. job) end
      local key = spec.k[spec.n]
      local m = find_entry(key, raw)
      if not m then
        bad('missing wait ' .. job)
      else
        members[m] = true
        local z = find(m, '\0', #key + ENTRY_JOB, true)
        local y = find(m, '\0', z + 1, true)
        if sub(m, #key + ENTRY_JOB, z - 1) ~= job or entry_raw(m, #key, y) ~= raw then bad('wait entry differs from spec ' .. job) end
        if sub(m, z + 1, z + #key + 4) ~= '\5' .. key .. '\1' .. spec.ip then bad('flow field of another key or priority ' .. job) end
      end
    end
  end
  for j = 1, held do holders[spec.k[j]] = (holders[spec.k[j]] or 0) + 1 end
end
for job, _ in pairs(admitted) do
  if not specs[job] then bad('lease without job ' .. job) end
end
for job, _ in pairs(records) do
  if not specs[job] then bad('limits record without job ' .. job) end
end
if earliest then
  local d = tonumber(meta[DUE])
  if not d then bad('leases without due') elseif d > earliest then bad('due after the earliest lease') end
end
for key, c in pairs(counts) do
  if (holders[key] or 0) ~= c then bad('count mismatch on ' .. key) end
end
for key, c in pairs(holders) do
  if not counts[key] then bad('holds without count on ' .. key .. ' ' .. c) end
  if not limits[key] then bad('holders without limit on ' .. key) end
end
local waiters, floor_waiters, per_flow, last_seq = {}, {}, {}, {}
for _, m in ipairs(call('ZRANGE', K_WAITS, 0, -1)) do -- in queue order
  if not members[m] then bad('wait entry without parked job ' .. m) end
  local kz = find(m, '\0', 1, true)
  local key = sub(m, 1, kz - 1)
  waiters[key] = true
  local a, b = byte(m, kz + 1, kz + 2)
  if a >= FLOOR_BASE and a < HEX_LOW and b >= FLOOR_BASE and b < HEX_LOW then
    floor_waiters[key] = true
  elseif not find(sub(m, kz + 1, kz + 2), '^[0-9a-f][0-9a-f]$') then
    bad('malformed priority bytes ' .. m)
  end
  local z = find(m, '\0', #key + ENTRY_JOB, true)
  local y = z and find(m, '\0', z + 1, true)
  if y then
    local fl = sub(m, z + 2, y - 1) -- key \1 fp, the flow's records less their first byte
    per_flow[fl] = (per_flow[fl] or 0) + 1
    local o = kz + 1 -- the order bytes: ip, tag, backlog start, seq
    local tag, start, seq = sub(m, o + 2, o + 17), sub(m, o + 18, o + 29), sub(m, o + 30, o + 41)
    local fin = finish[fl]
    if not fin then
      bad('waiters without flow records ' .. fl)
    else
      if sub(fin, 17) ~= start then bad('backlog start differs from its flow ' .. m) end
      if tonumber(sub(fin, 1, 16), 16) < tonumber(tag, 16) then bad('finish tag behind a waiter ' .. m) end
    end
    if last_seq[fl] and last_seq[fl] >= seq then bad('flow out of arrival order ' .. m) end
    last_seq[fl] = seq
  else
    bad('malformed wait entry ' .. m)
  end
end
for fl, c in pairs(fcount) do
  if per_flow[fl] ~= c then bad('flow count mismatch ' .. fl) end
  if not finish[fl] then bad('flow count without finish tag ' .. fl) end
end
for fl, _ in pairs(finish) do
  if not fcount[fl] then bad('finish tag without flow count ' .. fl) end
end
for fl, _ in pairs(per_flow) do
  if not fcount[fl] then bad('waiters without flow count ' .. fl) end
end
for key, _ in pairs(waiters) do
  if (counts[key] or 0) < (limits[key] or 0) - (reserves[key] or 0) then bad('room with waiters on ' .. key) end
  if floor_waiters[key] and (counts[key] or 0) < (limits[key] or 0) then bad('room with floor-band waiters on ' .. key) end
  if not limits[key] then bad('waiters without limit on ' .. key) end
end
return problems

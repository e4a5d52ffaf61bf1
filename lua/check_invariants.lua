-- check_invariants.lua: consistency audit for tests and operators. O(state): never on a
-- hot path.
-- KEYS: the 8 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: none
-- Checks: counts equal the holds ZSET per key; every spec's held keys are in holds and
-- a parked spec has its wait entry; wcount matches waits; no key with waiters has room
-- (counts < limit); only admitted jobs have leases.
-- Returns: {problem description, ...} (empty when consistent)
local problems = {}
local function bad(msg) problems[#problems + 1] = msg end
local holds_per_key = {}
for _, m in ipairs(call('ZRANGE', K_HOLDS, 0, -1)) do
  local key = sub(m, 1, string.find(m, '\0', 1, true) - 1)
  holds_per_key[key] = (holds_per_key[key] or 0) + 1
end
local counts = call('HGETALL', K_COUNTS)
local seen = {}
for i = 1, #counts, 2 do
  local key, c = counts[i], tonumber(counts[i + 1])
  seen[key] = true
  if (holds_per_key[key] or 0) ~= c then bad('count mismatch on ' .. key) end
end
for key, c in pairs(holds_per_key) do
  if not seen[key] then bad('holds without count on ' .. key .. ' ' .. c) end
end
local waiters_per_key, wc = {}, {}
for _, m in ipairs(call('ZRANGE', K_WAITS, 0, -1)) do
  local z = string.find(m, '\0', 1, true)
  local key = sub(m, 1, z - 1)
  local p = 255 - tonumber(sub(m, z + 1, z + 2), 16)
  waiters_per_key[key] = (waiters_per_key[key] or 0) + 1
  local f = key .. '\0' .. p
  wc[f] = (wc[f] or 0) + 1
end
local wcount = call('HGETALL', K_WCOUNT)
local wseen = {}
for i = 1, #wcount, 2 do
  wseen[wcount[i]] = true
  if wc[wcount[i]] ~= tonumber(wcount[i + 1]) then bad('wcount mismatch') end
end
for f, _ in pairs(wc) do
  if not wseen[f] then bad('wcount missing') end
end
for key, _ in pairs(waiters_per_key) do
  local l = tonumber(call('HGET', K_LIMITS, key)) or 0
  local c = tonumber(call('HGET', K_COUNTS, key)) or 0
  if c < l then bad('room with waiters on ' .. key) end
end
local jobs = call('HGETALL', K_JOBS)
for i = 1, #jobs, 2 do
  local job, spec = jobs[i], parse(jobs[i + 1])
  for j = 1, spec.n - 1 do
    if not call('ZSCORE', K_HOLDS, spec.k[j] .. '\0' .. job) then bad('missing hold ' .. job) end
  end
  local lease = call('ZSCORE', K_LEASES, job)
  if spec.st == 'w' then
    if not call('ZSCORE', K_WAITS, wait_member(spec.k[spec.n], spec, job)) then bad('missing wait ' .. job) end
    if lease then bad('parked job with lease ' .. job) end
  elseif not lease then
    bad('running job without lease ' .. job)
  end
end
if call('ZCARD', K_LEASES) * 2 > #jobs then bad('lease without job') end
return problems

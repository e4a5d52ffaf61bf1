-- inspect_key.lua: one key's state for dashboards and tests (read only).
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: key, list holders (1|0)
-- Holders are not indexed (that would cost every admit a write): they are found by
-- scanning the tag's jobs, O(jobs of the tag). Waiters per priority cost O(log n) per
-- priority present in each band (a ZLEXCOUNT per priority of the key's queue).
-- Without the holder list the call is O(log n) (the count is a field of `state`).
-- Returns: {limit (-1 if none: never set, or the key is idle), holders {job_id, ...} (sorted; empty unless listed), waiters per priority
--           {priority, count, ...} (highest priority first, both bands together), total
--           waiters, holder count, reserve (effective; 0 when none or idle), waiters of the
--           floor band}
local key = ARGV[1]
local r = call('HMGET', K_STATE, key, '\0' .. key)
local count, limit, reserve = tonumber(r[1]) or 0, -1, 0
if r[2] then limit, reserve = lr(r[2]) end
local holders = {}
if count > 0 and ARGV[2] == '1' then
  local admitted = {}
  for _, j in ipairs(call('ZRANGE', K_LEASES, 0, -1)) do admitted[j] = true end
  local fields = call('HGETALL', K_STATE)
  for i = 1, #fields, 2 do
    if byte(fields[i], 1) == 2 then
      local job, spec = sub(fields[i], 2), parse(fields[i + 1])
      local held = admitted[job] and #spec.k or spec.n - 1
      for j = 1, held do
        if spec.k[j] == key then
          holders[#holders + 1] = job
          break
        end
      end
    end
  end
  table.sort(holders)
end
local per, total, floor_total = {}, 0, 0
local base = key .. '\0'
local lo = '[' .. base
while true do
  local first = call('ZRANGEBYLEX', K_WAITS, lo, '(' .. key .. '\1', 'LIMIT', 0, 1)[1]
  if not first then break end
  local ip = sub(first, #base + 1, #base + 2)
  local floor = byte(ip, 1) < HEX_LOW
  local p = tonumber(real_ip(ip), 16)
  -- The waiters of one priority in one band: [base..ip, base..nxt), nxt being the next
  -- priority's bytes in the same band; the floor band's lowest priority ends where the
  -- general band starts ('0'), the general band's with the key's range.
  local nxt
  if p < 255 then
    nxt = fmt('%02x', p + 1)
    if floor then nxt = floor_ip(nxt) end
  elseif floor then
    nxt = '0'
  end
  local hi = nxt and '(' .. base .. nxt or '(' .. key .. '\1'
  local c = call('ZLEXCOUNT', K_WAITS, '[' .. base .. ip, hi)
  per[255 - p] = (per[255 - p] or 0) + c
  total = total + c
  if floor then floor_total = floor_total + c end
  if not nxt then break end
  lo = '[' .. base .. nxt
end
local prios = {}
for p, _ in pairs(per) do prios[#prios + 1] = p end
table.sort(prios, function(a, b) return a > b end)
local by_prio = {}
for _, p in ipairs(prios) do
  by_prio[#by_prio + 1] = p
  by_prio[#by_prio + 1] = per[p]
end
return {limit, holders, by_prio, total, count, reserve, floor_total}

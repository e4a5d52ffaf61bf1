-- inspect_key.lua: one key's state for dashboards and tests (read only).
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: key, list holders (1|0)
-- Holders are not indexed (that would cost every admit a write): they are found by
-- scanning the tag's jobs, O(jobs of the tag). Waiters per priority cost O(log n) per
-- priority present (a ZLEXCOUNT per priority band of the key's queue).
-- Without the holder list the call is O(log n) (the count is a field of `state`).
-- Returns: {limit (-1 if none: never set, or the key is idle), holders {job_id, ...} (sorted; empty unless listed), waiters per priority
--           {priority, count, ...} (highest priority first), total waiters, holder count}
local key = ARGV[1]
local r = call('HMGET', K_STATE, key, '\0' .. key)
local count, limit = tonumber(r[1]) or 0, tonumber(r[2]) or -1
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
local by_prio, total = {}, 0
local base = key .. '\0'
local lo = '[' .. base
while true do
  local first = call('ZRANGEBYLEX', K_WAITS, lo, '(' .. key .. '\1', 'LIMIT', 0, 1)[1]
  if not first then break end
  local ip = sub(first, #base + 1, #base + 2)
  local p = tonumber(ip, 16)
  -- The band of one priority: [base..ip, base..(ip+1)); the lowest priority ("ff") ends
  -- with the key's range.
  local hi = p < 255 and '(' .. base .. fmt('%02x', p + 1) or '(' .. key .. '\1'
  local c = call('ZLEXCOUNT', K_WAITS, '[' .. base .. ip, hi)
  by_prio[#by_prio + 1] = 255 - p
  by_prio[#by_prio + 1] = c
  total = total + c
  if p == 255 then break end
  lo = '[' .. base .. fmt('%02x', p + 1)
end
return {limit, holders, by_prio, total, count}

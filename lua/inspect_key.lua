-- inspect_key.lua: one key's state for dashboards and tests (read only).
-- KEYS: the 8 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: key
-- Returns: {limit (-1 if never set), holders {job_id, ...} (sorted), waiters per priority
--           {priority, count, ...} (highest priority first), total waiters, holder count}
local key = ARGV[1]
local limit = tonumber(call('HGET', K_LIMITS, key)) or -1
local rows = call('ZRANGEBYLEX', K_HOLDS, '[' .. key .. '\0', '(' .. key .. '\1')
local holders = {}
for i = 1, #rows do holders[i] = sub(rows[i], #key + 2) end
local fields = {}
for p = 250, 0, -1 do fields[#fields + 1] = key .. '\0' .. p end
local counts = call('HMGET', K_WCOUNT, unpack(fields))
local by_prio, total = {}, 0
for i = 1, #counts do
  local c = tonumber(counts[i])
  if c and c > 0 then
    by_prio[#by_prio + 1] = 251 - i
    by_prio[#by_prio + 1] = c
    total = total + c
  end
end
return {limit, holders, by_prio, total, tonumber(call('HGET', K_COUNTS, key)) or 0}

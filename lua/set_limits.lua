-- set_limits.lua: an operator changes limits; a raised limit wakes waiters at once.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: require_ready (1|0), then key, limit pairs (limits ints >= 0, "L:R" with a reserve
--       R, see lr; keys sorted).
-- Does: store each changed limit (and reserve); where it rose, or the reserve fell, and left
-- room on a key with waiters, hand
-- on. A lowered limit evicts nobody: nobody new gets in until holders drop below it.
-- With require_ready=1 on a tag not ready (see init_tag.lua) nothing is stored or woken.
-- Returns: woken {job_id, data, ...}
local nk = (#ARGV - 1) / 2
if nk == 0 then return {} end
-- The stored limits, "\1due" and "\1ready" in one read.
local fields = {}
for a = 2, #ARGV, 2 do fields[#fields + 1] = '\0' .. ARGV[a] end
fields[nk + 1], fields[nk + 2] = DUE, READY
local old = call('HMGET', K_STATE, unpack_(fields))
if ARGV[1] == '1' and not old[nk + 2] then return {} end
clock()
read_due(old[nk + 1])
store_limits(ARGV, 2, old, W)
return W

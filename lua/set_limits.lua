-- set_limits.lua: an operator changes limits; a raised limit wakes waiters at once.
-- KEYS: the 3 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: require_ready (1|0), then key, limit pairs (limits ints >= 0, keys sorted).
-- Does: store each changed limit; where it rose and left room on a key with waiters, hand
-- on. A lowered limit evicts nobody: nobody new gets in until holders drop below it.
-- With require_ready=1 on a tag not ready (see init_tag.lua) nothing is stored or woken.
-- Returns: woken {job_id, data, ...}
local woken = {}
local fields = {}
for a = 2, #ARGV, 2 do fields[#fields + 1] = '\0' .. ARGV[a] end
local guarded = ARGV[1] == '1'
if guarded then fields[#fields + 1] = READY end
if #fields == 0 then return woken end
local old = call('HMGET', K_STATE, unpack_(fields))
if guarded and not old[#old] then return woken end
clock()
due = tonumber(call('HGET', K_STATE, DUE))
store_limits(ARGV, 2, old, W)
return W

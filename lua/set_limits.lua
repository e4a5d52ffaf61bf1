-- set_limits.lua: an operator changes limits; a raised limit wakes waiters at once.
-- KEYS: the 8 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: key, limit pairs (limits ints >= 0), handled in the order given.
-- Does: store each limit; where it rose and left room on a key with waiters, hand on.
-- A lowered limit evicts nobody: nobody new gets in until holders drop below it.
-- Returns: woken {job_id, data, ...}
local woken = {}
store_limits(1, now_ms(), woken)
return woken

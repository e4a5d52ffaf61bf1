-- _lib.lua: helpers shared by every engine script. The loader (fairqueue/engine/scripts.py)
-- prepends this file to each script before registering it, so the grant/handoff logic
-- exists exactly once.
--
-- KEYS (identical for every script, all under one `{tag}` hash slot, see keys.py):
--   1 jobs   HASH job_id -> spec (layout below)
--   2 counts HASH key -> holders        3 limits HASH key -> last limit passed
--   4 holds  ZSET key\0job (score 0)     5 waits  ZSET key\0<255-p:2 hex><seq:16 hex>\0job
--   6 wcount HASH key\0priority -> parked count
--   7 leases ZSET job -> lease expiry (ms, Redis TIME)   8 seq STRING arrival counter
-- Spec: one string with a fixed-width header, so a state change rewrites the header and
-- reuses the rest verbatim (cjson encode/decode cost more than the rest of an admit):
--   [1] status "w" parked | "r" admitted   [2] n = index of the next key to take, as a byte
--   (#keys+1 = holds all)   [3-4] 255-priority, 2 hex   [5-20] wait seq, 16 hex (parked)
--   [21..] lease ms .. "\0" .. key1 .. "\0" .. key2 ... .. "\1" .. data (keys sorted)
-- Invariant kept by every script: if a key has waiters then counts[key] >= limits[key].
local K_JOBS, K_COUNTS, K_LIMITS, K_HOLDS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_WAITS, K_WCOUNT, K_LEASES, K_SEQ = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local call = redis.call
local fmt, sub, find, byte, char = string.format, string.sub, string.find, string.byte, string.char
local NOSEQ = '0000000000000000'

-- Redis server time in milliseconds: the single clock of the engine.
local function now_ms()
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function parse(raw)
  local tail = sub(raw, 21)
  local z = find(tail, '\1', 1, true)
  local ks = sub(tail, 1, z - 1)
  local pos = find(ks, '\0', 1, true)
  local k = {}
  while true do
    local nxt = find(ks, '\0', pos + 1, true)
    if not nxt then
      k[#k + 1] = sub(ks, pos + 1)
      break
    end
    k[#k + 1] = sub(ks, pos + 1, nxt - 1)
    pos = nxt
  end
  return {
    st = sub(raw, 1, 1), n = byte(raw, 2), ip = sub(raw, 3, 4), q = sub(raw, 5, 20), tail = tail, k = k,
    ls = tonumber(sub(ks, 1, find(ks, '\0', 1, true) - 1)), d = sub(tail, z + 1),
  }
end

local function encode(s)
  return s.st .. char(s.n) .. s.ip .. s.q .. s.tail
end

local function prio(spec)
  return 255 - tonumber(spec.ip, 16)
end

local function wait_member(key, spec, job)
  return key .. '\0' .. spec.ip .. spec.q .. '\0' .. job
end

-- 1-based place of a parked job in its key's queue: O(log n).
local function position(key, spec, job)
  return call('ZLEXCOUNT', K_WAITS, '[' .. key .. '\0', '[' .. wait_member(key, spec, job))
end

local function wcount_down(key, spec)
  local wf = key .. '\0' .. prio(spec)
  if call('HINCRBY', K_WCOUNT, wf, -1) <= 0 then call('HDEL', K_WCOUNT, wf) end
end

-- Take the job's keys from spec.n on while they have room; park on the first full one.
-- `lims` optionally caches limits the caller already read. Returns true when the job
-- holds every key (it then has a lease), false when parked. Writes the spec.
local function grant(job, spec, now, lims)
  local k, n = spec.k, spec.n
  while n <= #k do
    local key = k[n]
    local l = lims and lims[key] or tonumber(call('HGET', K_LIMITS, key)) or 0
    -- Count first (one command on the common, admitted path); undo if there was no room.
    local c = call('HINCRBY', K_COUNTS, key, 1)
    if c > l then
      if c > 1 then call('HINCRBY', K_COUNTS, key, -1) else call('HDEL', K_COUNTS, key) end
      spec.n = n
      spec.st = 'w'
      spec.q = fmt('%016x', call('INCR', K_SEQ))
      call('ZADD', K_WAITS, 0, wait_member(key, spec, job))
      call('HINCRBY', K_WCOUNT, key .. '\0' .. prio(spec), 1)
      call('HSET', K_JOBS, job, encode(spec))
      return false
    end
    call('ZADD', K_HOLDS, 0, key .. '\0' .. job)
    n = n + 1
  end
  spec.n = n
  spec.st = 'r'
  spec.q = NOSEQ
  call('HSET', K_JOBS, job, encode(spec))
  call('ZADD', K_LEASES, now + spec.ls, job)
  return true
end

-- While `key` has room and waiters, give the head waiter (highest priority, then FIFO)
-- the slot and let it go on to take its later keys. Fully admitted jobs are appended to
-- `woken` as job_id, data pairs. `c` is the holder count to start from and `stored` the
-- value now in Redis (both read when nil); the count is written back once at the end
-- (safe: a woken job only goes on to later keys, never this one).
local function handoff(key, now, woken, c, stored)
  if not c then
    stored = tonumber(call('HGET', K_COUNTS, key)) or 0
    c = stored
  end
  local l = tonumber(call('HGET', K_LIMITS, key)) or 0
  if c < l then
    local lo, hi = '[' .. key .. '\0', '(' .. key .. '\1'
    local skip = #key + 21
    while c < l do
      local head = call('ZRANGEBYLEX', K_WAITS, lo, hi, 'LIMIT', 0, 1)[1]
      if not head then break end
      call('ZREM', K_WAITS, head)
      local job = sub(head, skip)
      local spec = parse(call('HGET', K_JOBS, job))
      wcount_down(key, spec)
      call('ZADD', K_HOLDS, 0, key .. '\0' .. job)
      c = c + 1
      spec.n = spec.n + 1
      if grant(job, spec, now) then
        woken[#woken + 1] = job
        woken[#woken + 1] = spec.d
      end
    end
  end
  if c ~= stored then
    if c > 0 then call('HSET', K_COUNTS, key, c) else call('HDEL', K_COUNTS, key) end
  end
end

-- Remove a job entirely: its wait entry (a waiter leaving never frees room), its lease
-- and spec, then each held key in canonical order, handing each on as it frees (so a job
-- woken on an earlier key never barges past a later key's waiters).
local function drop(job, spec, now, woken)
  if spec.st == 'w' then
    local key = spec.k[spec.n]
    call('ZREM', K_WAITS, wait_member(key, spec, job))
    wcount_down(key, spec)
  else
    call('ZREM', K_LEASES, job)
  end
  call('HDEL', K_JOBS, job)
  local k = spec.k
  for i = 1, spec.n - 1 do
    local key = k[i]
    call('ZREM', K_HOLDS, key .. '\0' .. job)
    local stored = tonumber(call('HGET', K_COUNTS, key)) or 0
    handoff(key, now, woken, stored - 1, stored)
  end
end

-- Release up to `max` jobs whose lease ran out (earliest expiry first), appending them to
-- `reclaimed` as job_id, data pairs.
local function reclaim(now, max, woken, reclaimed)
  local due = call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, max)
  for i = 1, #due do
    local job = due[i]
    local raw = call('HGET', K_JOBS, job)
    if raw then
      local spec = parse(raw)
      reclaimed[#reclaimed + 1] = job
      reclaimed[#reclaimed + 1] = spec.d
      drop(job, spec, now, woken)
    else
      call('ZREM', K_LEASES, job)
    end
  end
end

-- Store limits passed as ARGV[first], ARGV[first+1], ... pairs (keys sorted), all at
-- once; then hand on every key whose limit rose, in REVERSE canonical order: a job woken
-- on a key only goes on to later keys, whose queues are then already served, so it can
-- never barge past their waiters. Returns the keys and a key -> limit table.
local function store_limits(first, now, woken)
  local keys, lims, raised = {}, {}, {}
  for i = first, #ARGV, 2 do
    local key, lim = ARGV[i], tonumber(ARGV[i + 1])
    keys[#keys + 1] = key
    lims[key] = lim
    local old = tonumber(call('HGET', K_LIMITS, key))
    if old ~= lim then
      call('HSET', K_LIMITS, key, lim)
      if not old or lim > old then raised[#raised + 1] = key end
    end
  end
  for i = #raised, 1, -1 do
    handoff(raised[i], now, woken)
  end
  return keys, lims
end

-- (end of _lib.lua)

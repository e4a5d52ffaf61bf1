-- _lib.lua: helpers shared by every engine script. The loader (fairqueue/engine/scripts.py)
-- prepends this file to each script before registering it, so the grant/handoff logic
-- exists exactly once.
--
-- KEYS (identical for every script, all under one `{tag}` hash slot, see keys.py):
--   1 jobs   HASH job_id -> spec (layout below)
--   2 counts HASH  key -> holders (field deleted at 0) | "\0"..key -> last limit passed
--                  | "\1seq" -> arrival counter | "\1ready" -> 1 once init_tag ran
--   3 waits  ZSET key\0<255-p:2 hex><seq:16 hex>\0job (score 0)
--   4 leases ZSET job -> lease expiry (ms, Redis TIME); exactly the fully admitted jobs
-- Key names contain neither \0 nor \1, so the field kinds of `counts` never collide, and
-- one HMGET reads a job's counts and limits together.
-- Spec: one string with a fixed-width header, so a state change rewrites the header and
-- reuses the rest verbatim (cjson encode/decode cost more than the rest of an admit):
--   [1] n = index of the key the job is parked on, as a byte (#keys+1 when written by
--   admit)   [2-3] 255-priority, 2 hex   [4-19] wait seq, 16 hex
--   [20..] lease ms .. "\0" .. key1 .. "\0" .. key2 ... .. "\1" .. data (keys sorted)
-- A job is admitted iff it is in `leases` (then it holds all its keys and n is stale: a
-- handoff that completes a job does not rewrite its spec); otherwise it is parked on
-- key n, holds keys 1..n-1 and has its wait entry. Holders of a key are not indexed
-- (inspect scans the jobs: O(state), dashboards/tests only).
-- Invariant kept by every script: if a key has waiters then count >= limit, so a
-- newcomer only checks count < limit and cannot barge.
local K_JOBS, K_COUNTS, K_WAITS, K_LEASES = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local call = redis.call
local fmt, sub, find, byte, char = string.format, string.sub, string.find, string.byte, string.char
local NOSEQ = '0000000000000000'
local READY, SEQ = '\1ready', '\1seq'

-- Redis server time in milliseconds: the single clock of the engine.
local function now_ms()
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function parse(raw)
  local tail = sub(raw, 20)
  local z = find(tail, '\1', 1, true)
  local ks = sub(tail, 1, z - 1)
  local pos = find(ks, '\0', 1, true)
  local ls = tonumber(sub(ks, 1, pos - 1))
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
  return { n = byte(raw, 1), ip = sub(raw, 2, 3), q = sub(raw, 4, 19), tail = tail, k = k, ls = ls, d = sub(tail, z + 1) }
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

-- Park the job on keys[n] (it holds keys 1..n-1): fresh seq, wait entry, spec rewritten.
local function park(job, spec, n)
  spec.n = n
  spec.q = fmt('%016x', call('HINCRBY', K_COUNTS, SEQ, 1))
  call('ZADD', K_WAITS, 0, wait_member(spec.k[n], spec, job))
  call('HSET', K_JOBS, job, char(n) .. spec.ip .. spec.q .. spec.tail)
end

-- A job that holds keys 1..spec.n-1 goes on to take the rest while they have room,
-- parking on the first full one. Returns true when it holds every key (it then has a
-- lease; its spec is not rewritten), false when parked.
local function grant_rest(job, spec, now)
  local k = spec.k
  for n = spec.n, #k do
    local key = k[n]
    local r = call('HMGET', K_COUNTS, key, '\0' .. key)
    local c = tonumber(r[1]) or 0
    if c >= (tonumber(r[2]) or 0) then
      park(job, spec, n)
      return false
    end
    call('HSET', K_COUNTS, key, c + 1)
  end
  call('ZADD', K_LEASES, now + spec.ls, job)
  return true
end

-- `key` now has `c` holders (Redis holds `stored`) and limit `l`: while it has room and
-- waiters, give the head waiter (highest priority, then FIFO) the slot and let it go on
-- to its later keys. Fully admitted jobs are appended to `woken` as job_id, data pairs.
-- `full` says whether the key may have waiters at all: by the invariant only a key that
-- was full (count >= limit) can, so a release on a key that had room skips the lookup.
-- The count is written back once at the end (safe: a woken job only goes on to later
-- keys, never this one), so a release that hands its slot on writes no count at all.
local function handoff(key, c, l, stored, now, woken, full)
  if full and c < l then
    local lo, hi = '[' .. key .. '\0', '(' .. key .. '\1'
    local skip = #key + 21
    while c < l do
      local head = call('ZRANGEBYLEX', K_WAITS, lo, hi, 'LIMIT', 0, 1)[1]
      if not head then break end
      call('ZREM', K_WAITS, head)
      local job = sub(head, skip)
      local spec = parse(call('HGET', K_JOBS, job))
      c = c + 1
      spec.n = spec.n + 1
      if grant_rest(job, spec, now) then
        woken[#woken + 1] = job
        woken[#woken + 1] = spec.d
      end
    end
  end
  if c ~= stored then
    if c > 0 then call('HSET', K_COUNTS, key, c) else call('HDEL', K_COUNTS, key) end
  end
  return c ~= stored
end

-- Hand on `key` after its limit rose from `was` to `l`, reading its count. True if a
-- waiter got a slot (counts moved).
local function handoff_key(key, l, was, now, woken)
  local c = tonumber(call('HGET', K_COUNTS, key)) or 0
  return handoff(key, c, l, c, now, woken, c >= was)
end

-- Remove a job entirely: its spec, lease or wait entry (a waiter leaving never frees
-- room), then each held key in canonical order, handing each on as it frees (so a job
-- woken on an earlier key never barges past a later key's waiters). `admitted` is
-- looked up (the lease removed) when nil.
local function drop(job, spec, now, woken, admitted)
  call('HDEL', K_JOBS, job)
  local removed = call('ZREM', K_LEASES, job)
  if admitted == nil then admitted = removed == 1 end
  local k = spec.k
  local held = #k
  if not admitted then
    held = spec.n - 1
    call('ZREM', K_WAITS, wait_member(k[spec.n], spec, job))
  end
  for i = 1, held do
    local key = k[i]
    local r = call('HMGET', K_COUNTS, key, '\0' .. key)
    local c, l = tonumber(r[1]) or 0, tonumber(r[2]) or 0
    handoff(key, c - 1, l, c, now, woken, c >= l)
  end
end

-- Release up to `max` jobs whose lease ran out (earliest expiry first), appending them to
-- `reclaimed` as job_id, data pairs. One cheap ZCOUNT when nothing is due.
local function reclaim(now, max, woken, reclaimed)
  if call('ZCOUNT', K_LEASES, '-inf', now) == 0 then return end
  local due = call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'LIMIT', 0, max)
  for i = 1, #due do
    local job = due[i]
    local raw = call('HGET', K_JOBS, job)
    if raw then
      local spec = parse(raw)
      reclaimed[#reclaimed + 1] = job
      reclaimed[#reclaimed + 1] = spec.d
      drop(job, spec, now, woken, true)
    else
      call('ZREM', K_LEASES, job)
    end
  end
end

-- Compare the limits passed as ARGV[first], ARGV[first+1], ... pairs (keys sorted) with
-- `old` (old[i] = stored limit of the i-th key, string or false), store the changed ones
-- with one HSET, then hand on every key whose limit
-- rose, in REVERSE canonical order: a job woken on a key only goes on to later keys,
-- whose queues are then already served, so it can never barge past their waiters. A key
-- with no stored limit has no waiters (every admit stores its keys' limits first).
-- Returns true when a waiter got a slot (counts read before are stale).
local function store_limits(first, old, now, woken)
  local set, raised = {}, {}
  local i = 0
  for a = first, #ARGV, 2 do
    i = i + 1
    local lim, was = tonumber(ARGV[a + 1]), tonumber(old[i])
    if was ~= lim then
      set[#set + 1] = '\0' .. ARGV[a]
      set[#set + 1] = lim
      if was and lim > was then
        raised[#raised + 1] = a
        raised[#raised + 1] = was
      end
    end
  end
  if #set > 0 then call('HSET', K_COUNTS, unpack(set)) end
  local moved = false
  for j = #raised - 1, 1, -2 do
    local a = raised[j]
    if handoff_key(ARGV[a], tonumber(ARGV[a + 1]), raised[j + 1], now, woken) then moved = true end
  end
  return moved
end

-- (end of _lib.lua)

-- _lib.lua: helpers shared by every engine operation.
--
-- The engine is one Redis Functions library (FUNCTION LOAD, called with FCALL): the loader
-- (fairqueue/engine/scripts.py) puts this file first and wraps each lua/<op>.lua in a
-- registered function. Helpers are therefore compiled and created once per library load,
-- not on every call as with EVAL, where this prologue was a large part of every call (figures
-- in docs/engine.md, "Where the time goes"). Redis 7.0 exposes no globals (string, redis.call, ...) while a library
-- loads, so they are bound on the first call (bind).
--
-- KEYS (identical for every operation, all under one `{tag}` hash slot, see keys.py):
--   1 state  HASH  key -> holders (field deleted at 0) | "\0"..key -> last limit passed
--                  while the key is in use, "L" or "L:R" with its reserve R (see lr;
--                  deleted with the count when it goes idle)
--                  | "\2"..job -> spec (layout below) | "\3"..job -> the limits its admit
--                  passed, "l1\0l2..." (a multi-key job parked before its last key: when
--                  it goes on to a later key that went idle meanwhile, it brings its limit),
--                  then "\2" and its flows argument (flows, guards) when not ""
--                  | "\1seq" -> arrival counter | "\1ready" -> 1 once init_tag ran
--                  | "\1due" -> lower bound of every lease expiry in `leases` (absent
--                  when there are none)
--                  | "\4"..key.."\1"..fp -> the flow's last finish tag (16 hex) and the
--                  start of its backlog (12 hex) | "\5"..key.."\1"..fp -> how many of the
--                  flow's jobs wait on key at that priority; fp = <255-p: 2 hex, or its
--                  floor band form (floor_ip)>..flow.
--                  Both exist exactly while that count is above 0 (see park, flow_left).
--   2 waits  ZSET  key\0<order: 42 bytes>\0job\0<"\5"..key.."\1"..fp>\0<spec> (score 0,
--                  see ENTRY_JOB); the order is 255-p, the virtual start tag, the flow's
--                  backlog start, seq
--   3 leases ZSET  job -> lease expiry (ms, server time); exactly the fully admitted jobs
--   4 clock  STRING  empty, expiring at CLOCK_END: the server clock as one integer (clock)
-- Key names contain none of \0 \1 \2 \3 and job ids no \0, so the field kinds of `state` never
-- collide and one HMGET reads a job's spec, its keys' counts and limits and the meta fields.
-- A job's spec (the "\2" field and the end of its wait entry) is one string with a
-- fixed-width header: its layout and the names of its offsets are below (SPEC_*).
-- A job is admitted iff it is in `leases` (then it holds all its keys and its spec's header
-- is stale: a handoff that completes a job does not rewrite the spec); otherwise it is
-- parked on key n, holds keys 1..n-1 and has its wait entry. The wait entry carries the
-- spec, so a handoff reads nothing but the queue head. Holders of a key are not indexed
-- (inspect scans the jobs: O(state), dashboards/tests only).
-- Invariant kept by every operation: if a key has waiters then count >= limit - reserve, and
-- if it has waiters of the floor band then count >= limit, so a newcomer only checks
-- count < limit - reserve (count < limit within its guarantee) and cannot barge past a
-- waiter of its own band or a better one (docs/engine.md, "Reserves and guarantees"). A
-- key with holders or waiters has
-- a stored limit; an idle key has none (so the tag's hash does not keep one field per key
-- ever used), and the next job to use it brings its own.
--
-- Numbers cross into Redis as strings made here (int, ms) and come back through num: a
-- Lua number passed to redis.call is printed with "%.17g" and tonumber() parses a string
-- twice, both measurable in a release (docs/engine.md).
local K_STATE, K_WAITS, K_LEASES, K_CLOCK
local call, fmt, sub, find, byte, char, floor, unpack_
-- IP["7"] = hex of 255-7, the priority part of a wait entry, cached for the priorities in
-- use (at most 256 entries). Filled lazily: every object in the Functions VM is marked by
-- each GC cycle, which every FCALL pays for, so a table prefilled with all 256 costs calls
-- that never use most of it.
local IP, ip_cached = {}, 0
local INT, VAL = {}, {} -- INT[7] = "7", VAL["7"] = 7 for the small counts and limits
-- The order bytes of a spec that never waited (admitted at once): tag, backlog start, seq.
local NOSEQ = '0000000000000000000000000000000000000000'
local ZERO_TAG = '0000000000000000'
local READY, SEQ, DUE = '\1ready', '\1seq', '\1due'
-- The floor band (docs/engine.md, "Reserves and guarantees"): a waiter that parked within
-- its guarantee has each hex digit d of its wait order's 255-priority written as the
-- character FLOOR_BASE + d. Those sort below every hex digit (HEX_LOW is '0'), so the band's
-- entries come before all others of the key and keep their priority order among themselves;
-- the flow records follow (their fp holds the same two bytes).
local FLOOR_BASE, HEX_LOW = 32, 48

-- The spec, byte by byte (1-based, as string.byte and string.sub count):
--   [1]      n: index of the key the job is parked on, as a byte (#keys+1 once admitted)
--   [2]      number of keys, as a byte
--   [3-4]    255-priority, 2 hex          \
--   [5-20]   virtual start tag, 16 hex     | the wait order (42 bytes): a wait entry
--   [21-32]  the flow's backlog start, 12 hex | copies them, so a key's queue sorts by
--   [33-44]  wait seq, 12 hex             /  priority, tag, backlog start, arrival
--   [45-54]  lease ms, 10 digits zero-padded (admit_job stores ARGV[3] as given)
--   [55..]   key1 "\0" key2 ... (sorted) "\1" data
-- Bytes 45.. (the tail) never change: a state change rewrites the 44-byte header and reuses
-- the tail verbatim, and the hot paths read single bytes at these offsets instead of
-- decoding the whole string. Upvalues, so naming them costs nothing on the hot paths.
local SPEC_N, SPEC_NK = 1, 2 -- the parked-on key index, the key count
local SPEC_PRIO = 3 -- first byte of the wait order (priority, tag, backlog start, seq)
local SPEC_TAG = 5 -- first byte of the virtual start tag
local SPEC_SEQ = 33 -- first byte of the wait seq
local SPEC_TAIL = 45 -- first byte of the tail, which starts with the lease
local SPEC_LEASE_END = 54 -- last lease digit
local SPEC_KEYS = 55 -- first byte of the first key name
-- A wait entry is key "\0" <the spec's wait order, bytes SPEC_PRIO..SPEC_TAIL-1> "\0" job
-- "\0" fc "\0" <spec bytes 1-2> <spec bytes SPEC_TAIL..>: fc is the name of the flow's count
-- field, "\5" key "\1" fp, fp being the 2 priority bytes and the flow of the key it waits
-- on (so a handoff has the name without building it); the spec follows without its order
-- bytes, which the entry holds already (entry_raw puts them back). The job id starts at
-- byte #key + ENTRY_JOB (after #key, "\0", 42 order bytes, "\0"); with z the "\0" that
-- ends the job id, fc is bytes z+1 .. y-1 where y is the next "\0" (fc holds none); then
-- spec bytes SPEC_N, SPEC_NK are entry bytes y + SPEC_N, y + SPEC_NK, the lease is y +
-- ENTRY_LEASE .. y + ENTRY_LEASE_END and the first key starts at y + ENTRY_KEYS.
local ENTRY_JOB = 45
local ORDER_LEN = SPEC_TAIL - SPEC_PRIO -- 42
local ENTRY_LEASE = SPEC_TAIL - ORDER_LEN -- 3
local ENTRY_LEASE_END, ENTRY_KEYS = SPEC_LEASE_END - ORDER_LEN, SPEC_KEYS - ORDER_LEN -- 12, 13
-- Fair order (docs/engine.md, "Fair order"): a parked job's virtual start tag is
-- max(V, its flow's last finish tag on that key and priority), V being the tag of the
-- key's head waiter at that priority (0 when none); its finish tag adds its cost,
-- DEFAULT_COST / weight (ops.flow_cost: DEFAULT_COST is weight 1; mirrored by
-- ops.DEFAULT_COST). Tags stop growing at TAG_MAX (exact in a double's 53 bits): a queue
-- that never empties for ~2^33 jobs of weight 1 then orders its new waiters by arrival.
local DEFAULT_COST = 1048576
local TAG_MAX = 9007199254740991
-- Expired leases an operation other than the sweep reclaims when one is due: it bounds the
-- extra work of any one call (reclaim_leases, the sweep, takes its max from the caller).
-- Mirrored by INLINE_RECLAIM in fairqueue/engine/ops.py.
local RECLAIM_BATCH = 8
-- The clock key expires at CLOCK_END ms (year 33658); a PTTL read outside CLOCK_LEFT (a
-- now before 2017 or after 2248) means someone else set it: TIME is used and it is reset.
local CLOCK_END, CLOCK_END_S = 1e15, '1000000000000000'
local CLOCK_LEFT_MIN, CLOCK_LEFT_MAX = 1e15 - 8.8e12, 1e15 - 1.5e12

-- Per-call state, set at the start of every call (clock(), then read_due()): library-level
-- locals outlive a call (Redis Functions keep the library's Lua state), but Redis runs one
-- function at a time, so a call only ever sees its own values.
local now -- Redis server time, ms: the single clock of the engine
local due -- the stored "\1due" (number) or nil when no lease exists
-- Set when a grant (a woken job going on to its later keys) wrote the count of a key other
-- than the one being handed on: from then on the counts and limits a release read in its
-- first HMGET may be stale, so drop/free_held read each key again (see free_held).
local touched
-- Woken and reclaimed job_id, data pairs of the current call. Reused (emptied by clock())
-- rather than allocated per call: every table a call creates is measurable garbage.
local W, R = {}, {}
-- Pending writes of one drop: HSET field, value pairs and HDEL fields (reused likewise).
local SETS, DELS = {}, {}

-- Bind the globals, on the first call of each operation (every operation first takes the
-- tag's KEYS into K_*, inline: see scripts.py).
local function bind()
  call, fmt, sub, find, byte, char = redis.call, string.format, string.sub, string.find, string.byte, string.char
  floor, unpack_ = math.floor, unpack
  for i = 0, 63 do
    INT[i] = tostring(i)
    VAL[INT[i]] = i
  end
end

-- The priority part of a wait entry for the priority string `p` of ARGV.
local function ip_of(p)
  local ip = IP[p]
  if ip then return ip end
  ip = fmt('%02x', 255 - p)
  if ip_cached < 256 then
    IP[p] = ip
    ip_cached = ip_cached + 1
  end
  return ip
end

-- An integer as the decimal string Redis stores.
local function int(n)
  return INT[n] or fmt('%d', n)
end

-- A stored decimal string (or false: a missing field) as a number (nil when missing).
local function num(s)
  if s then return VAL[s] or s + 0 end
end

-- Cross-call memos (this and key_s below). Unlike the per-call state above they are meant
-- to outlive a call: Redis Functions keep library-level locals between calls, so the next
-- call finds them. Each is keyed by the very string it was computed from and is used only
-- when the new string is equal, so a value left by another call, another tag or another
-- key can never be used wrongly; at worst it misses and is recomputed. (A library reload,
-- FUNCTION FLUSH or a restart starts them empty.)
-- The last "\1due" and lease strings converted, and their numbers. Both change rarely
-- (the earliest expiry moves when that lease ends; leases come from a few settings), and
-- a string-to-number conversion (strtod) on every call is measurable (docs/engine.md).
local due_s, due_n, ls_s, ls_n = false, nil, false, nil
-- The strings a one-key release builds from its key (its limit's field name, its queue's
-- lex range, the spec's keys part), for the last key released: consecutive releases hit
-- the same key when it is busy, and a key with waiters is one. Keyed by the key itself,
-- so a stale entry is never used; a miss costs one compare.
local key_s, key_limit, key_lo, key_hi, key_spec = false, nil, nil, nil, nil

-- The last limit string lr parsed (not a small one, which VAL holds) and its parts.
local lr_s, lr_l, lr_r = false, 0, 0

-- A stored or passed limit string (false: missing) as its limit and effective reserve:
-- "L" has none, "L:R" keeps min(R, L) of the L slots (ops.py sends R only when 0 < R <= L).
-- A missing one is 0, 0. The plain string stays a number string so the busy-key release
-- (which compares it with a count) and a small limit's VAL lookup cost what they did.
local function lr(s)
  if not s then return 0, 0 end
  local v = VAL[s]
  if v then return v, 0 end
  if s ~= lr_s then
    local x = find(s, ':', 2, true)
    if x then
      lr_l, lr_r = sub(s, 1, x - 1) + 0, sub(s, x + 1) + 0
      if lr_r > lr_l then lr_r = lr_l end
    else
      lr_l, lr_r = s + 0, 0
    end
    lr_s = s
  end
  return lr_l, lr_r
end

-- The slots of a key with limit string `s` open to a job outside its guarantee.
local function open_slots(s)
  local l, rv = lr(s)
  return l - rv
end

-- The floor band's form of a general wait order's two priority hex digits, and back
-- (real_ip leaves a general one as it is).
local function hexval(b)
  return b < 97 and b - 48 or b - 87
end

local function floor_ip(ip)
  local a, b = byte(ip, 1, 2)
  return char(FLOOR_BASE + hexval(a), FLOOR_BASE + hexval(b))
end

local function real_ip(ip)
  local a, b = byte(ip, 1, 2)
  if a >= HEX_LOW then return ip end
  return fmt('%x%x', a - FLOOR_BASE, b - FLOOR_BASE)
end

-- Remember the strings of `key` (called on a miss only: key ~= key_s).
local function key_strings(key)
  key_s, key_limit, key_lo, key_hi, key_spec = key, '\0' .. key, '[' .. key .. '\0', '(' .. key .. '\1', key .. '\1'
end

-- Set `due` from the stored "\1due" string (false when missing).
local function read_due(s)
  if s ~= due_s then due_s, due_n = s, num(s) end
  due = due_n
end

-- A lease duration string (10 digits, ms) as a number.
local function lease_ms(s)
  if s ~= ls_s then ls_s, ls_n = s, s + 0 end
  return ls_n
end

-- Redis server time, read as CLOCK_END minus the clock key's PTTL (the same millisecond as
-- TIME: both read the server's clock). TIME replies with an array, and a Lua table costs
-- Redis about as much as a whole command (TIME with its conversion measured about twice a
-- PTTL, docs/engine.md). The key is missing after a loss of data or an
-- eviction (only it, of our keys, has an expiry): then TIME, and it is set again.
local function clock()
  local left = call('PTTL', K_CLOCK)
  if left > CLOCK_LEFT_MIN and left < CLOCK_LEFT_MAX then
    now = CLOCK_END - left
  else
    local t = call('TIME')
    now = t[1] * 1000 + floor(t[2] / 1000)
    call('SET', K_CLOCK, '', 'PXAT', CLOCK_END_S)
  end
  touched = false
  for i = #W, 1, -1 do W[i] = nil end
  for i = #R, 1, -1 do R[i] = nil end
end

-- A spec string from its parts (`q`: the 40 order bytes after the priority).
local function spec_raw(n, nk, ip, q, tail)
  return char(n, nk) .. ip .. q .. tail
end

-- Every field of a spec (cold paths and multi-key grants; the hot paths read only the
-- bytes they need, see release_job and handoff).
local function parse(raw)
  local y = find(raw, '\1', SPEC_KEYS, true)
  local ks = sub(raw, SPEC_KEYS, y - 1)
  local k, pos = {}, 0
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
    n = byte(raw, SPEC_N), nk = byte(raw, SPEC_NK), ip = sub(raw, SPEC_PRIO, SPEC_TAG - 1),
    tail = sub(raw, SPEC_TAIL),
    k = k, ls = lease_ms(sub(raw, SPEC_TAIL, SPEC_LEASE_END)), d = sub(raw, y + 1), raw = raw,
  }
end

-- Whether a spec's keys are exactly `names` (\0-separated, as stored): a release's hint is
-- checked without splitting anything.
local function has_keys(raw, names)
  return byte(raw, SPEC_KEYS + #names) == 1 and find(raw, names, SPEC_KEYS, true) == SPEC_KEYS
end

local function prio(spec)
  return 255 - tonumber(real_ip(spec.ip), 16)
end

-- The wait entry of a job parked on `key` with spec string `raw`, its flow's count field
-- being `fc`: ordered by key, then the spec's wait order (priority, tag, backlog start,
-- arrival); the rest makes the entry self-contained (fc names the flow's records).
local function wait_entry(key, raw, job, fc)
  return key .. '\0' .. sub(raw, SPEC_PRIO, SPEC_TAIL - 1) .. '\0' .. job .. '\0' .. fc .. '\0' .. sub(raw, 1, 2) .. sub(raw, SPEC_TAIL)
end

-- The spec string of the wait entry `m` of a key of `klen` bytes (y: the "\0" after its
-- flow's count field): its first two bytes, the order bytes from the entry's prefix, its tail.
local function entry_raw(m, klen, y)
  return sub(m, y + 1, y + 2) .. sub(m, klen + 2, klen + 1 + ORDER_LEN) .. sub(m, y + ENTRY_LEASE)
end

-- The wait entry of a job parked on `key` with spec `raw`, found by its order bytes (unique:
-- they end with the arrival seq), or nil: O(log n). Cold paths (withdrawal, audit).
local function find_entry(key, raw)
  local pre = key .. '\0' .. sub(raw, SPEC_PRIO, SPEC_TAIL - 1)
  return call('ZRANGEBYLEX', K_WAITS, '[' .. pre .. '\0', '(' .. pre .. '\1', 'LIMIT', '0', '1')[1]
end

-- 1-based place of a parked job in its key's queue: O(log n).
local function position(key, raw)
  return call('ZLEXCOUNT', K_WAITS, '[' .. key .. '\0', '(' .. key .. '\0' .. sub(raw, SPEC_PRIO, SPEC_TAIL - 1) .. '\1')
end

-- Lease a job that now holds every key; keeps "\1due" a lower bound of all expiries.
local function lease(job, ls)
  local e = now + ls
  local es = fmt('%d', e)
  call('ZADD', K_LEASES, es, job)
  if not due or e < due then
    due = e
    call('HSET', K_STATE, DUE, es)
  end
end

-- What a job passed for its i-th key besides the limit: flow, cost, and its guard's index
-- among the job's keys with its guarantee (0, 0 without a guard). `fa` is the admit's flows
-- argument: "" when every key has the default flow "" at weight 1 (cost DEFAULT_COST) and no
-- key a reserve or guard (ops.flows_arg; so then no limit passed carries a reserve),
-- otherwise per key flow "\1" cost, then "\1" guard index "\1" guarantee for a key with a
-- guard, joined by "\0" in key order (flows hold no \0 or \1: ops.py).
local function key_arg(fa, i)
  if not fa or fa == '' then return '', DEFAULT_COST, 0, 0 end
  local pos = 1
  for _ = 2, i do pos = find(fa, '\0', pos, true) + 1 end
  local z = find(fa, '\0', pos, true)
  local e = z and z - 1 or #fa
  local x = find(fa, '\1', pos, true)
  local y = find(fa, '\1', x + 1, true)
  if not y or y > e then return sub(fa, pos, x - 1), sub(fa, x + 1, e) + 0, 0, 0 end
  local w = find(fa, '\1', y + 1, true)
  return sub(fa, pos, x - 1), sub(fa, x + 1, y - 1) + 0, sub(fa, y + 1, w - 1) + 0, sub(fa, w + 1, e) + 0
end

-- Whether an admit's job, about to hold its keys before the one it passed guard index `g`
-- and guarantee `q` for (key_arg), is within its guarantee there: it has a guard (g > 0)
-- and the guard's count (`r` read the counts as admit_read orders them, before the job's
-- own holds), its own hold included, is at most the guarantee.
local function admit_within(r, g, q)
  return g > 0 and (num(r[2 * g - 1]) or 0) + 1 <= q
end

-- The holder count of `key` now, during a handoff of `hkey` (whose count `hc` the handoff
-- writes only at its end) and, in a drop (`batch`), with the counts of the keys freed
-- before it pending in SETS (see drop). Read for a woken job's guard only.
local function live_count(key, hkey, hc, batch)
  if key == hkey then return hc end
  if batch then
    for j = 1, #SETS - 1, 2 do
      if SETS[j] == key then return num(SETS[j + 1]) end
    end
  end
  return num(call('HGET', K_STATE, key)) or 0
end

-- Fair order, on the park path only. A job about to wait on `key` at priority `ip` (2 hex)
-- in `flow` with `cost` (ops.flow_cost: DEFAULT_COST / weight) and fresh arrival seq `seq`
-- (12 hex) gets the virtual start tag
--   max(V, F)   V: the tag of the key's head waiter at this priority (0 when none),
--               F: the flow's last finish tag here (only while the flow has waiters here)
-- and the flow's finish tag becomes tag + cost. While a flow has waiters here F >= the tag of
-- each of them >= V, so max(V, F) = F and the head is not even read. The backlog start is
-- the seq of the job that began the flow's current backlog: equal tags are served in the
-- order the flows began to wait, which keeps equally weighted backlogged flows within one
-- job of each other (docs/engine.md). Appends the flow's two records (finish tag and start;
-- waiter count) to `set` as field, value pairs; returns the 40 order bytes after the
-- priority and the name of the flow's count field (for the wait entry).
local function fair_order(key, ip, flow, cost, seq, set)
  local fp = key .. '\1' .. ip .. flow
  local fr, fc = '\4' .. fp, '\5' .. fp
  local rec = call('HMGET', K_STATE, fr, fc)
  local cnt = num(rec[2]) or 0
  local tag, start
  if cnt > 0 and rec[1] then
    tag, start = sub(rec[1], 1, 16), sub(rec[1], 17)
  else
    cnt = 0
    local kl = #key
    local head = call('ZRANGEBYLEX', K_WAITS, '[' .. key .. '\0' .. ip, '(' .. key .. '\1', 'LIMIT', '0', '1')[1]
    if head and sub(head, kl + 2, kl + 3) == ip then tag = sub(head, kl + 4, kl + 19) else tag = ZERO_TAG end
    start = seq
  end
  local fin = tonumber(tag, 16) + cost
  if fin > TAG_MAX then fin = TAG_MAX end
  set[#set + 1], set[#set + 2] = fr, fmt('%016x', fin) .. start
  set[#set + 1], set[#set + 2] = fc, int(cnt + 1)
  return tag .. start .. seq, fc
end

-- A waiter whose flow's count field is `fc` left its key's queue (handed a slot, or
-- withdrawn): one fewer of its flow waits there; at none, the flow's records go (with
-- `batch`, in drop's HDEL).
-- A withdrawn waiter leaves the flow's finish tag as it was: its later jobs queue behind
-- the place it held, never before an earlier job of the flow.
local function flow_left(fc, batch)
  if call('HINCRBY', K_STATE, fc, -1) > 0 then return end
  if batch then
    DELS[#DELS + 1] = '\4' .. sub(fc, 2)
    DELS[#DELS + 1] = fc
  else
    call('HDEL', K_STATE, '\4' .. sub(fc, 2), fc)
  end
end

-- Park the job on its n-th key (it holds keys 1..n-1) in `flow` with `cost`, in the floor
-- band when `floor` (within its guarantee there): fresh seq, fair order, wait entry, spec
-- rewritten; `lim`, when given, is the key's limit to store (it had none: it was idle).
-- The spec's priority bytes may be in the floor band form of the key it waited on before:
-- its real priority is taken back first.
local function park(job, spec, n, lim, flow, cost, floor)
  local key = spec.k[n]
  local set = {}
  local ip = real_ip(spec.ip)
  if floor then ip = floor_ip(ip) end
  local q, fc = fair_order(key, ip, flow, cost, fmt('%012x', call('HINCRBY', K_STATE, SEQ, 1)), set)
  local raw = spec_raw(n, spec.nk, ip, q, spec.tail)
  call('ZADD', K_WAITS, 0, wait_entry(key, raw, job, fc))
  set[#set + 1], set[#set + 2] = '\2' .. job, raw
  if lim then set[#set + 1], set[#set + 2] = '\0' .. key, lim end
  call('HSET', K_STATE, unpack_(set))
end

-- What `job` passed at admission for its i-th key (from its "\3" record `all`, a string or
-- false): the limit (a string, with its reserve), the flow, the cost, the guard's index and
-- the guarantee (key_arg).
local function own(all, i)
  if not all then return '0', '', DEFAULT_COST, 0, 0 end -- only a damaged state lacks it: park there (audit flags it)
  local x = find(all, '\2', 1, true)
  local pos = 1
  for _ = 2, i do pos = find(all, '\0', pos, true) + 1 end
  local z = find(all, '\0', pos, true)
  if x and (not z or z > x) then z = x end
  local flow, cost, g, q = key_arg(x and sub(all, x + 1) or '', i)
  return sub(all, pos, z and z - 1 or #all), flow, cost, g, q
end

-- A job that holds keys 1..n-1 goes on to take the rest while they have room, parking on
-- the first full one. Returns true when it holds every key (it then has a lease; its spec
-- is not rewritten), false when parked. It was woken by a handoff of `hkey`, now at `hc`
-- holders (`batch`: in a drop), which live_count needs to read its guard's count: a key with
-- a reserve takes it past limit - reserve only within its guarantee, and the band it parks
-- in says whether it was.
local function grant_rest(job, spec, n, hkey, hc, batch)
  local k = spec.k
  local rec -- its "\3" record, read when first needed
  for i = n, #k do
    local key = k[i]
    local r = call('HMGET', K_STATE, key, '\0' .. key)
    local c = num(r[1]) or 0
    local stored = r[2]
    local lim = stored
    if not stored then -- an idle key (no holders) forgot its limit: the job brings its own
      rec = rec or call('HGET', K_STATE, '\3' .. job)
      lim = own(rec, i)
    end
    local l, rv = lr(lim)
    if c >= l - rv then
      rec = rec or call('HGET', K_STATE, '\3' .. job)
      local _, flow, cost, g, q = own(rec, i)
      local floor = g > 0 and live_count(k[g], hkey, hc, batch) <= q
      if c >= l or not floor then
        park(job, spec, i, not stored and lim, flow, cost, floor)
        return false
      end
    end
    if stored then
      call('HSET', K_STATE, key, int(c + 1))
    else
      call('HSET', K_STATE, key, int(c + 1), '\0' .. key, lim)
    end
    touched = true
  end
  lease(job, spec.ls)
  return true
end

-- The head waiter `m` of a key of `klen` bytes got its slot (z, y: the "\0"s after its job
-- id and its flow's count field): let it take its later keys (or, on its last key, just lease it,
-- reading only the bytes needed). Returns the job and its data when it now holds every
-- key, nil when it parked on a later key. `key`, `c` and `batch` are the handoff's (see
-- grant_rest).
local function wake(m, klen, z, y, key, c, batch)
  local job = sub(m, klen + ENTRY_JOB, z - 1)
  local n = byte(m, y + SPEC_N) + 1 -- the next key to take
  if n > byte(m, y + SPEC_NK) then
    lease(job, lease_ms(sub(m, y + ENTRY_LEASE, y + ENTRY_LEASE_END)))
    return job, sub(m, find(m, '\1', y + ENTRY_KEYS, true) + 1)
  end
  local spec = parse(entry_raw(m, klen, y))
  if grant_rest(job, spec, n, key, c, batch) then return job, spec.d end
  return nil
end

-- `key` now has `c` holders (Redis holds `stored`), limit `l` and reserve `rv`: while it has
-- room and waiters, give the head waiter (the floor band first, then highest priority, then
-- fair order) the slot and let it go on to its later keys; a head of the general band only
-- while c < l - rv (the reserved slots are kept for the floor band). Fully admitted jobs are
-- appended to `woken` as job_id, data pairs.
-- `full` says whether the key may have waiters at all: by the invariant only a key that
-- was full (count >= limit - reserve) can, so a release on a key that had room skips the lookup.
-- The count is written back once at the end (safe: a woken job only goes on to later
-- keys, never this one), so a release that hands its slot on writes no count at all; with
-- `batch` it is appended to the pending writes of drop (see there) instead, and so are the
-- records of a flow left with no waiter (safe for the same reason: nothing parks on this
-- key later in the drop). A key left with no holder and a limit above its reserve has
-- nobody waiting (the loop found no head, or it had room before): it is idle and its
-- limit (with its reserve) goes with its count. (Waiters of a key whose every slot is
-- reserved, a limit-0 key among them, keep it.)
local function handoff(key, c, l, rv, stored, woken, full, batch)
  if full and c < l then
    local lo, hi = '[' .. key .. '\0', '(' .. key .. '\1'
    local klen = #key
    local open = l - rv
    while c < l do
      local head = call('ZRANGEBYLEX', K_WAITS, lo, hi, 'LIMIT', '0', '1')[1]
      if not head then break end
      if c >= open and byte(head, klen + 2) >= HEX_LOW then break end -- a general head: kept slots
      call('ZREM', K_WAITS, head)
      local z = find(head, '\0', klen + ENTRY_JOB, true)
      local y = find(head, '\0', z + 1, true)
      flow_left(sub(head, z + 1, y - 1), batch)
      c = c + 1
      local job, data = wake(head, klen, z, y, key, c, batch)
      if job then
        woken[#woken + 1] = job
        woken[#woken + 1] = data
      end
    end
  end
  if c ~= stored then
    if batch then
      if c > 0 then
        SETS[#SETS + 1] = key
        SETS[#SETS + 1] = int(c)
      else
        DELS[#DELS + 1] = key
        if l > rv then DELS[#DELS + 1] = '\0' .. key end
      end
    elseif c > 0 then
      call('HSET', K_STATE, key, int(c))
    elseif l > rv then
      call('HDEL', K_STATE, key, '\0' .. key)
    else
      call('HDEL', K_STATE, key)
    end
  end
  return c ~= stored
end

-- Hand on `key` after its limit rose to `l` or its limit less its reserve `rv` rose (from
-- `was`: the old limit less reserve), reading its count. True if a waiter got a slot
-- (counts moved).
local function handoff_key(key, l, rv, was, woken)
  local c = num(call('HGET', K_STATE, key)) or 0
  return handoff(key, c, l, rv, c, woken, c >= was)
end

-- The second half of drop, for a job whose spec and lease are already gone: remove its
-- wait entry if it was parked (a waiter leaving never frees room), then free each key it
-- held in canonical order, handing each on as it frees (so a job woken on an earlier key
-- never barges past a later key's waiters). `raw` is its spec string, its keys are
-- k[ko+1] .. k[ko+n] (a slice, so a caller's ARGV serves without a copy). `cl`, when
-- given, holds the counts and limits of the keys read beforehand (cl[co+2i-1], cl[co+2i]
-- for key i); they are trusted only until a woken job writes counts of other keys.
local function free_held(job, raw, k, ko, woken, admitted, cl, co)
  local held = byte(raw, SPEC_NK)
  if not admitted then
    held = byte(raw, SPEC_N) - 1
    local key = k[ko + held + 1]
    local m = find_entry(key, raw)
    if m then
      call('ZREM', K_WAITS, m)
      local z = find(m, '\0', #key + ENTRY_JOB, true)
      -- Not deferred to drop's HDEL: a job woken below on an earlier key may go on to
      -- park on this (later) key in this very call and start the flow's records anew.
      flow_left(sub(m, z + 1, find(m, '\0', z + 1, true) - 1), false)
    end
  end
  for i = 1, held do
    local key = k[ko + i]
    local c, l, rv
    if cl and not touched then
      c = num(cl[co + 2 * i - 1]) or 0
      l, rv = lr(cl[co + 2 * i])
    else
      local r = call('HMGET', K_STATE, key, '\0' .. key)
      c = num(r[1]) or 0
      l, rv = lr(r[2])
    end
    handoff(key, c - 1, l, rv, c, woken, c >= l - rv, true)
  end
end

-- Remove a job entirely: its lease, then free_held, then its spec. `admitted` is looked up
-- (from the lease removal) when nil. The new counts of the keys it frees are written in
-- one HSET at the end, and the spec goes in one HDEL with the counts that reached zero:
-- a three-key release writes its hash in 2 commands instead of 4. Safe to defer: a job woken on a key
-- only goes on to later keys, whose counts are still those in Redis (the keys are freed
-- in order), and nothing else reads them before the end of the drop.
local function drop(job, raw, k, ko, woken, admitted, cl, co)
  for i = #SETS, 1, -1 do SETS[i] = nil end -- emptied here, not after: one place to clear
  for i = #DELS, 2, -1 do DELS[i] = nil end
  DELS[1] = '\2' .. job
  if byte(raw, SPEC_NK) > 1 then DELS[2] = '\3' .. job end -- its limits record, if it parked
  local removed = call('ZREM', K_LEASES, job)
  if admitted == nil then admitted = removed == 1 end
  free_held(job, raw, k, ko, woken, admitted, cl, co)
  if #SETS > 0 then call('HSET', K_STATE, unpack_(SETS)) end
  call('HDEL', K_STATE, unpack_(DELS))
end

-- Release up to `max` jobs whose lease ran out (earliest expiry first), appending them to
-- `reclaimed` as job_id, data pairs, then store the new earliest expiry in "\1due". The
-- common path is free: operations only come here when now >= due (the sweep always does).
local function reclaim(max, woken, reclaimed)
  local expired = call('ZRANGEBYSCORE', K_LEASES, '-inf', fmt('%d', now), 'LIMIT', '0', int(max))
  for i = 1, #expired do
    local job = expired[i]
    local raw = call('HGET', K_STATE, '\2' .. job)
    if raw then
      local spec = parse(raw)
      reclaimed[#reclaimed + 1] = job
      reclaimed[#reclaimed + 1] = spec.d
      drop(job, raw, spec.k, 0, woken, true, nil, 0)
    else
      call('ZREM', K_LEASES, job)
    end
  end
  local first = call('ZRANGE', K_LEASES, 0, 0, 'WITHSCORES')
  local earliest = num(first[2])
  if earliest ~= due then
    if earliest then call('HSET', K_STATE, DUE, first[2]) else call('HDEL', K_STATE, DUE) end
    due = earliest
  end
end

-- Reclaim when some lease may have run out (`due` has been read by the caller).
local function reclaim_due(max, woken, reclaimed)
  if due and due <= now then
    reclaim(max, woken, reclaimed)
    return true
  end
  return false
end

-- Compare the limits passed as argv[first], argv[first+1], ... pairs (keys sorted; limit
-- strings with their reserves, see lr) with `old` (old[i] = stored limit of the i-th key,
-- string or false), store the changed ones with one HSET, then hand on every key where a
-- waiter may now fit (its limit rose: room for the floor band; or its limit less its
-- reserve rose: room for the general band, a lowered reserve among the ways), in REVERSE
-- canonical order: a job woken on a key only goes on to later keys, whose queues are then
-- already served, so it can never barge past their waiters. A key with no stored limit has
-- no waiters (every admit stores its keys' limits first). Returns true when a waiter got a
-- slot.
local function store_limits(argv, first, old, woken)
  local set, raised = {}, {}
  local i = 0
  for a = first, #argv, 2 do
    i = i + 1
    local s, ws = argv[a + 1], old[i]
    if s ~= ws then
      set[#set + 1] = '\0' .. argv[a]
      set[#set + 1] = s
      if ws then
        local l, rv = lr(s)
        local wl, wr = lr(ws)
        if l > wl or l - rv > wl - wr then
          raised[#raised + 1] = a
          raised[#raised + 1] = wl - wr
        end
      end
    end
  end
  if #set > 0 then call('HSET', K_STATE, unpack_(set)) end
  local moved = false
  for j = #raised - 1, 1, -2 do
    local a = raised[j]
    local l, rv = lr(argv[a + 1])
    if handoff_key(argv[a], l, rv, raised[j + 1], woken) then moved = true end
  end
  return moved
end

-- admit_job's one read: counts and limits of its nk keys (ARGV[7], ARGV[9], ...), then its
-- spec, "\1due", "\1seq" and "\1ready". The one-key shape builds no argument table.
local function admit_read(argv, nk, jf)
  if nk == 1 then
    local key = argv[7]
    return call('HMGET', K_STATE, key, '\0' .. key, jf, DUE, SEQ, READY)
  end
  local fields = {}
  for i = 1, nk do
    local key = argv[5 + 2 * i]
    fields[2 * i - 1] = key
    fields[2 * i] = '\0' .. key
  end
  fields[2 * nk + 1], fields[2 * nk + 2], fields[2 * nk + 3], fields[2 * nk + 4] = jf, DUE, SEQ, READY
  return call('HMGET', K_STATE, unpack_(fields))
end

-- A flat reply: head values, then #woken, then woken and reclaimed pairs.
local function reply(head, woken, reclaimed)
  head[#head + 1] = #woken
  for i = 1, #woken do head[#head + 1] = woken[i] end
  for i = 1, #reclaimed do head[#head + 1] = reclaimed[i] end
  return head
end

-- The reply of release and cancel: `found` (1|0) alone when nothing was woken or
-- reclaimed; the one woken job of a found job as the string job_id .. "\0" .. data (job
-- ids hold no \0): a table reply costs Redis far more than a string (docs/engine.md);
-- otherwise the flat table {found, #woken, woken ..., reclaimed ...}.
local function done(found)
  if #R == 0 then
    if #W == 0 then return found end
    if #W == 2 and found == 1 then return W[1] .. '\0' .. W[2] end
  end
  return reply({found}, W, R)
end

-- (end of _lib.lua)

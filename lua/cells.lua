-- cells: per-cell summaries of the jobs waiting in each cell, kept as jobs move
-- (fairqueue.jobs.cells). A cell is an opaque name; each has a sorted set of its job ids
-- scored by the time it started waiting (fairqueue.jobs.cells.wait_score), and the summary
-- hash keeps each cell's "<count> <oldest score>" in one field, so a reader gets every
-- cell's figures with one HGETALL, whatever the backlog. A cell named "p|..." (a tenant's
-- parked jobs) is only counted: its jobs are in no sorted set (one would cost a parked job
-- a third member, and its oldest is read by nobody), its count is kept in prefix.."counted"
-- and its summary is "<count>" alone.
-- All keys share the {cells} hash tag (one slot): the cell sets are named from KEYS[1]'s
-- prefix inside the script, which Redis Cluster allows within one slot.
-- KEYS[1]  prefix of every key, e.g. "fq:{cells}:"
-- ARGV     operations, one after another:
--   "set" job score n cell1..celln   the job is in exactly these cells (others left)
--   "reset" job score n cell1..celln the same, but only if the job is in some cell now (a
--                                    job that left meanwhile, say started, stays out)
--   "park" job score cell            the job is also in `cell`, if it is in some cell now
--   "del" job                        the job is in no cell (it left the waiting state)
--   "unpark" job                     the job leaves its cells named "p|..."
-- Every call that changes the summary bumps prefix.."version" and scores the cells it
-- changed with the new version in prefix.."changes" (a sorted set: one member per cell,
-- its last change), so a reader that kept the summary at a version reads only the cells
-- changed since (fairqueue.jobs.cells.cells_refresh). A version created afresh (a new or
-- flushed server, a rebuild) gets a new prefix.."epoch" (the server's clock, in
-- microseconds): a reader never mistakes a restarted count for the one it kept. Past
-- CHANGES_KEPT cells (checked every TRIM_EVERY versions) the oldest leave the log;
-- prefix.."trimmed" is then the newest version that left it (a reader that kept an older
-- one reads everything).
-- Checks may come first, before any operation; all are decided before anything is written,
-- and one that fails refuses the whole call (nothing applied):
--   "quota" name n limit k cell1..cellk  the jobs counted in these cells plus n stay <= limit
--   "guard" name n exempt k cell1..cellk  the same against the memory guard's cap
--                                        (prefix.."guard", set while the guard is on), unless
--                                        exempt is "1"
--   "rate" name n rate burst             a token bucket of `burst` tokens refilled at `rate`
--                                        per second (prefix.."rate:"..name): taken when it
--                                        holds min(n, burst) tokens (a bulk past the burst
--                                        leaves it in debt), else refused
-- Returns the number of operations applied, or a refusal {check, name, count, cap} (rate:
-- {"rate", name, seconds until the bucket holds enough, as a string}).
local prefix = KEYS[1]
local summary = prefix .. 'summary'
local of = prefix .. 'of'
local counted = prefix .. 'counted'
local CHANGES_KEPT = 200000
local TRIM_EVERY = 1000
local changed, changed_list = {}, {}

-- A cell's set changed: its summary is written once, when the call's operations are done
-- (summarise), however many of them changed it (a bulk's jobs enter the same two cells).
-- Nothing reads the summary in between: the call is atomic.
local function refresh(cell)
  if not changed[cell] then
    changed[cell] = true
    changed_list[#changed_list + 1] = cell
  end
end

local function is_counted(cell)
  return string.sub(cell, 1, 2) == 'p|'
end

-- Write the summary of every cell the call changed: "<count> <oldest score>" ("<count>"
-- for a counted cell), or none.
local function summarise()
  for k = 1, #changed_list do
    local cell = changed_list[k]
    if is_counted(cell) then
      local n = tonumber(redis.call('HGET', counted, cell) or '0')
      if n <= 0 then
        redis.call('HDEL', summary, cell)
        redis.call('HDEL', counted, cell)
      else
        redis.call('HSET', summary, cell, n)
      end
    else
      local z = prefix .. 'z:' .. cell
      local n = redis.call('ZCARD', z)
      if n == 0 then
        redis.call('HDEL', summary, cell)
      else
        local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
        redis.call('HSET', summary, cell, n .. ' ' .. first[2])
      end
    end
  end
end

-- The job enters `cell` (`had`: the cells it is in, as a set): true if it was not in it.
local function enter(job, cell, score, had)
  if is_counted(cell) then
    if had[cell] then return false end
    redis.call('HINCRBY', counted, cell, 1)
  elseif redis.call('ZADD', prefix .. 'z:' .. cell, 'NX', score, job) == 0 then
    return false
  end
  refresh(cell)
  return true
end

local function cells_of(old)
  local had = {}
  for cell in string.gmatch(old, '[^\2]+') do had[cell] = true end
  return had
end

local function leave(job, cells, keep)
  for cell in string.gmatch(cells, '[^\2]+') do
    if not keep(cell) then
      if is_counted(cell) then
        redis.call('HINCRBY', counted, cell, -1)
        refresh(cell)
      elseif redis.call('ZREM', prefix .. 'z:' .. cell, job) == 1 then
        refresh(cell)
      end
    end
  end
end

local i, applied = 1, 0
local function counted(k, at)
  local total = 0
  if k == 0 then return total end
  local cells = {}
  for c = 1, k do cells[c] = ARGV[at + c - 1] end
  local got = redis.call('HMGET', summary, unpack(cells))
  for c = 1, k do
    if got[c] then total = total + tonumber(string.match(got[c], '^(%d+)')) end
  end
  return total
end
local bucket -- the rate check's, taken once every check passed
while ARGV[i] == 'quota' or ARGV[i] == 'guard' or ARGV[i] == 'rate' do
  local check, name, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if check == 'rate' then
    local rate, burst = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4])
    local key = prefix .. 'rate:' .. name
    local t = redis.call('TIME')
    local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
    local got = redis.call('HMGET', key, 'tokens', 'at')
    local tokens = burst
    if got[1] then tokens = math.min(burst, tonumber(got[1]) + (now - tonumber(got[2])) * rate) end
    local need = math.min(n, burst)
    if tokens < need then return {'rate', name, string.format('%.3f', (need - tokens) / rate)} end
    bucket = {key, tokens - n, now, math.ceil((burst - (tokens - n)) / rate * 1000) + 1000}
    i = i + 5
  else
    local limit, k = ARGV[i + 3], tonumber(ARGV[i + 4])
    local count = counted(k, i + 5)
    if check == 'quota' then
      if count + n > tonumber(limit) then return {'quota', name, count, tonumber(limit)} end
    elseif limit ~= '1' then -- a guard: `limit` says whether the jobs are exempt
      local cap = redis.call('GET', prefix .. 'guard')
      if cap and count + n > tonumber(cap) then return {'guard', name, count, tonumber(cap)} end
    end
    i = i + 5 + k
  end
end
if bucket then
  redis.call('HSET', bucket[1], 'tokens', string.format('%.6f', bucket[2]), 'at', string.format('%.6f', bucket[3]))
  redis.call('PEXPIRE', bucket[1], bucket[4])
end
while i <= #ARGV do
  local op, job = ARGV[i], ARGV[i + 1]
  local old = redis.call('HGET', of, job) or ''
  if op == 'set' or op == 'reset' then
    local score, n = ARGV[i + 2], tonumber(ARGV[i + 3])
    if op == 'set' or old ~= '' then
      local want, list = {}, {}
      for k = 1, n do
        local cell = ARGV[i + 3 + k]
        want[cell] = true
        list[#list + 1] = cell
      end
      local had = cells_of(old)
      leave(job, old, function(cell) return want[cell] end)
      for _, cell in ipairs(list) do
        enter(job, cell, score, had)
      end
      redis.call('HSET', of, job, table.concat(list, '\2'))
    end
    i = i + 4 + n
  elseif op == 'park' then
    local score, cell = ARGV[i + 2], ARGV[i + 3]
    if old ~= '' then
      if enter(job, cell, score, cells_of(old)) then redis.call('HSET', of, job, old .. '\2' .. cell) end
    end
    i = i + 4
  elseif op == 'del' then
    leave(job, old, function(cell) return false end)
    redis.call('HDEL', of, job)
    i = i + 2
  elseif op == 'unpark' then
    local kept = {}
    leave(job, old, function(cell)
      if is_counted(cell) then return false end
      kept[#kept + 1] = cell
      return true
    end)
    if #kept > 0 then redis.call('HSET', of, job, table.concat(kept, '\2')) end
    i = i + 2
  else
    summarise() -- what the operations before it changed stays written, summaries included
    return redis.error_reply('cells: unknown operation ' .. tostring(op))
  end
  applied = applied + 1
end
summarise()
if #changed_list > 0 then
  local version = redis.call('INCR', prefix .. 'version')
  if version == 1 then
    local now = redis.call('TIME')
    redis.call('SET', prefix .. 'epoch', now[1] .. string.format('%06d', tonumber(now[2])))
  end
  local changes = prefix .. 'changes'
  for k = 1, #changed_list do
    redis.call('ZADD', changes, version, changed_list[k])
  end
  -- Its size is checked once in TRIM_EVERY calls (each call's cost counts: a claim is one).
  local over = 0
  if version % TRIM_EVERY == 0 then over = redis.call('ZCARD', changes) - CHANGES_KEPT end
  if over > 0 then
    local last = redis.call('ZRANGE', changes, over - 1, over - 1, 'WITHSCORES')
    redis.call('ZREMRANGEBYRANK', changes, 0, over - 1)
    redis.call('SET', prefix .. 'trimmed', last[2])
  end
end
return applied

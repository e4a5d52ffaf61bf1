-- cells: per-cell summaries of the jobs waiting in each cell, kept as jobs move
-- (fairqueue.jobs.cells). A cell is an opaque name; each has a sorted set of its job ids
-- scored by the time it started waiting (fairqueue.jobs.cells.wait_score), and the summary
-- hash keeps each cell's "<count> <oldest score>" in one field, so a reader gets every
-- cell's figures with one HGETALL, whatever the backlog.
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
-- Returns the number of operations applied.
local prefix = KEYS[1]
local summary = prefix .. 'summary'
local of = prefix .. 'of'
local CHANGES_KEPT = 200000
local TRIM_EVERY = 1000
local changed, changed_list = {}, {}

-- A cell whose set changed. Its summary is written once, after every operation of the
-- call (a call is atomic: no reader sees the summary between two operations), so a bulk's
-- entries or a claim batch's departures in one cell cost one count and one read of its
-- oldest member, not one of each per job.
local function refresh(cell)
  if not changed[cell] then
    changed[cell] = true
    changed_list[#changed_list + 1] = cell
  end
end

local function summarise(cell)
  local z = prefix .. 'z:' .. cell
  local n = redis.call('ZCARD', z)
  if n == 0 then
    redis.call('HDEL', summary, cell)
  else
    local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
    redis.call('HSET', summary, cell, n .. ' ' .. first[2])
  end
end

local function leave(job, cells, keep)
  for cell in string.gmatch(cells, '[^\2]+') do
    if not keep(cell) then
      if redis.call('ZREM', prefix .. 'z:' .. cell, job) == 1 then refresh(cell) end
    end
  end
end

local i, applied = 1, 0
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
      leave(job, old, function(cell) return want[cell] end)
      for _, cell in ipairs(list) do
        if redis.call('ZADD', prefix .. 'z:' .. cell, 'NX', score, job) == 1 then refresh(cell) end
      end
      redis.call('HSET', of, job, table.concat(list, '\2'))
    end
    i = i + 4 + n
  elseif op == 'park' then
    local score, cell = ARGV[i + 2], ARGV[i + 3]
    if old ~= '' then
      if redis.call('ZADD', prefix .. 'z:' .. cell, 'NX', score, job) == 1 then
        refresh(cell)
        redis.call('HSET', of, job, old .. '\2' .. cell)
      end
    end
    i = i + 4
  elseif op == 'del' then
    leave(job, old, function(cell) return false end)
    redis.call('HDEL', of, job)
    i = i + 2
  elseif op == 'unpark' then
    local kept = {}
    leave(job, old, function(cell)
      if string.sub(cell, 1, 2) == 'p|' then return false end
      kept[#kept + 1] = cell
      return true
    end)
    if #kept > 0 then redis.call('HSET', of, job, table.concat(kept, '\2')) end
    i = i + 2
  else
    -- The operations before it stay applied (a script's writes are not undone): so do
    -- their cells' summaries, as when each was written at once.
    for k = 1, #changed_list do
      summarise(changed_list[k])
    end
    return redis.error_reply('cells: unknown operation ' .. tostring(op))
  end
  applied = applied + 1
end
for k = 1, #changed_list do
  summarise(changed_list[k])
end
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

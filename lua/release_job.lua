-- release_job.lua: a job is done (or gives up): free every key it holds and hand each
-- freed slot to that key's head waiter in the same call.
-- KEYS: the 3 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id, then optionally the job's keys (sorted) as a hint: their counts and limits
--       are read with the spec in one HMGET. A hint that does not match the stored spec
--       is ignored (the keys are then read from the spec), so it only ever saves a read.
-- Does: drop the job (spec, lease or wait entry), handing on each freed key in canonical
-- order; then reclaim up to 8 expired leases.
-- Returns: found 1|0 when nothing was woken or reclaimed; otherwise
--          {found 1|0, #woken, woken job_id, data ..., reclaimed job_id, data ...}
-- Common path (one key handed to its head waiter): TIME, HMGET, HDEL, ZREM, ZRANGEBYLEX,
-- ZREM, ZADD.
local job = ARGV[1]
clock()
local nh = #ARGV - 1
local r
if nh == 1 then
  local key = ARGV[2]
  r = call('HMGET', K_STATE, '\2' .. job, DUE, key, '\0' .. key)
else
  local fields = {'\2' .. job, DUE}
  for a = 2, #ARGV do
    fields[#fields + 1] = ARGV[a]
    fields[#fields + 1] = '\0' .. ARGV[a]
  end
  r = call('HMGET', K_STATE, unpack_(fields))
end
due = num(r[2])
local found = 0
local raw = r[1]
if raw then
  -- With a matching hint the keys are ARGV[2..] and their counts came with the spec.
  local hint = nh == 1 and ARGV[2] or (nh > 1 and table.concat(ARGV, '\0', 2) or nil)
  if hint and has_keys(raw, hint) then
    drop(job, raw, ARGV, 1, W, nil, r, 2)
  else
    drop(job, raw, parse(raw).k, 0, W, nil, nil, 0)
  end
  found = 1
end
reclaim_due(8, W, R)
if #R == 0 then
  if #W == 0 then return found end
  if #W == 2 then return {found, 2, W[1], W[2]} end
end
return reply({found}, W, R)

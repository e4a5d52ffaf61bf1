-- release_job.lua: a job is done (or gives up): free every key it holds and hand each
-- freed slot to that key's head waiter in the same call.
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: job_id, then optionally the job's keys (sorted) as a hint: their counts and limits
--       are read with the spec in one HMGET. A hint that does not match the stored spec
--       is ignored (the keys are then read from the spec), so it only ever saves a read.
-- Does: drop the job (spec, lease or wait entry), handing on each freed key in canonical
-- order; then reclaim up to RECLAIM_BATCH (_lib.lua) expired leases.
-- Returns: found 1|0 when nothing was woken or reclaimed; "job_id\0data" when the job was
--          found and one job woken, nothing reclaimed; otherwise
--          {found 1|0, #woken, woken job_id, data ..., reclaimed job_id, data ...}
-- Common path (one key handed to its head waiter): PTTL (the clock), HMGET, ZRANGEBYLEX,
-- ZREM, ZREM, HINCRBY (the head's flow count), HDEL, ZADD. A hinted one-key release at a full key takes the written-out
-- busy-key path below; every other release goes through drop (_lib.lua).
local job = ARGV[1]
local left = call('PTTL', K_CLOCK)
if left > CLOCK_LEFT_MIN and left < CLOCK_LEFT_MAX and #W == 0 and #R == 0 then
  now, touched = CLOCK_END - left, false -- clock(), inline: see the busy-key path below
else
  clock()
end
local nh = #ARGV - 1
local jf = '\2' .. job
local key = ARGV[2]
local r
if nh == 1 then
  if key ~= key_s then key_strings(key) end -- see key_s in _lib.lua
  r = call('HMGET', K_STATE, jf, DUE, key, key_limit)
else
  local fields = {jf, DUE}
  for a = 2, #ARGV do
    fields[#fields + 1] = ARGV[a]
    fields[#fields + 1] = '\0' .. ARGV[a]
  end
  r = call('HMGET', K_STATE, unpack_(fields))
end
local raw, ds = r[1], r[2]
if ds ~= due_s then due_s, due_n = ds, num(ds) end -- read_due, inline
due = due_n
if not raw then
  reclaim_due(RECLAIM_BATCH, W, R)
  return done(0)
end
if nh == 1 and r[3] == r[4] and find(raw, key_spec, SPEC_KEYS, true) == SPEC_KEYS and not (due and due <= now) then
  -- The release of a busy key, the engine's most frequent call, written out: the hint is
  -- right (the spec's keys are exactly `key`), no lease is due and the key is at its limit
  -- (count == limit, as stored strings), so the job holds the key and its slot goes to the
  -- head waiter, if any. A key with a reserve never gets here: its stored limit "L:R" equals
  -- no count, so it takes the general path, which keeps the reserved slots (handoff). It is a second copy of what drop, handoff and wake do for this
  -- case (the head lookup, the idle key's HDEL, the wait entry's offsets, the flow count
  -- of the head (flow_left), the lease), kept
  -- because the helper calls it avoids are a large part of a release on this Lua (figures:
  -- docs/engine.md, "The busy-key release"). A change to any of those (waiter order, the
  -- entry or spec layout, the flow records, how a key goes idle) must change both; the engine tests check
  -- that each exit leaves what the general path leaves.
  local head = call('ZRANGEBYLEX', K_WAITS, key_lo, key_hi, 'LIMIT', '0', '1')[1]
  if not head then -- full and nobody waits, so the job is not parked here: it held the key
    call('HDEL', K_STATE, jf)
    call('ZREM', K_LEASES, job)
    local c = (num(r[3]) or 0) - 1
    if c > 0 then call('HSET', K_STATE, key, int(c)) else call('HDEL', K_STATE, key, key_limit) end
    return 1 -- (at 0 it is idle: its limit goes too, see handoff)
  end
  -- The head's wait entry: its job id at kl + ENTRY_JOB, ended by the \0 at z; its flow's
  -- count field from z + 1, ended by the \0 at y; then its spec less the order bytes
  -- (see ENTRY_JOB in _lib.lua).
  local kl = #key
  local z = find(head, '\0', kl + ENTRY_JOB, true)
  local y = find(head, '\0', z + 1, true)
  local nk = byte(head, y + SPEC_NK)
  if nk == 1 and call('ZREM', K_LEASES, job) == 1 then
    -- A one-key head takes the slot and is leased; the count stands. One fewer of its
    -- flow waits here (flow_left, inline): at none, its records go with the spec.
    call('ZREM', K_WAITS, head)
    local fc = sub(head, z + 1, y - 1)
    if call('HINCRBY', K_STATE, fc, -1) > 0 then
      call('HDEL', K_STATE, jf)
    else
      call('HDEL', K_STATE, jf, '\4' .. sub(fc, 2), fc)
    end
    local woken = sub(head, kl + ENTRY_JOB, z - 1)
    local lss = sub(head, y + ENTRY_LEASE, y + ENTRY_LEASE_END)
    if lss ~= ls_s then ls_s, ls_n = lss, lss + 0 end -- lease_ms, inline
    local e = now + ls_n -- lease, inline (the `due` local is not read again by this call)
    local es = fmt('%d', e)
    call('ZADD', K_LEASES, es, woken)
    if not due or e < due then call('HSET', K_STATE, DUE, es) end
    return woken .. '\0' .. sub(head, y + ENTRY_KEYS + kl + 1) -- the data, after its one key and \1
  end
  -- A multi-key head, or the released job was parked: the general path below.
end
local hint = nh == 1 and key or (nh > 1 and table.concat(ARGV, '\0', 2) or nil)
if hint and has_keys(raw, hint) then
  drop(job, raw, ARGV, 1, W, nil, r, 2)
else
  drop(job, raw, parse(raw).k, 0, W, nil, nil, 0)
end
reclaim_due(RECLAIM_BATCH, W, R)
return done(1)

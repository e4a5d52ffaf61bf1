-- admit_jobs.lua: many admits of one tag in one call, each exactly as admit_job.lua would
-- do it alone, one after the other in the order given (a bulk submit: one FCALL instead of
-- one per job, and the jobs' shared arguments sent once).
-- KEYS: the 4 per-tag keys (see _lib.lua / fairqueue/engine/keys.py).
-- ARGV: runs of jobs alike, each: count, m (how many shared arguments follow), then the
--       shared arguments of admit_job in this order: priority, lease, require_ready, flows,
--       key, limit pairs (admit_job's ARGV[2], [3], [5], [6], [7..]); then count pairs of
--       job_id, data (admit_job's ARGV[1], [4]).
-- Returns: 1 when every job was admitted with nothing else to report (admit_job's reply 1
--          for each); otherwise one reply per job, in order, each admit_job's own reply.
-- Each admit reads the clock and reclaims due leases itself, as a call of its own would:
-- the jobs see the state the ones before them left. (Within one call the server's clock
-- does not move, so they all read the same millisecond.)
local out, plain = {}, true
local argv = {}
local a, na = 1, #ARGV
while a <= na do
  local count, m = ARGV[a] + 0, ARGV[a + 1] + 0
  for i = #argv, 1, -1 do argv[i] = nil end
  argv[1], argv[4] = '', ''
  argv[2], argv[3], argv[5], argv[6] = ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  for i = 5, m do argv[i + 2] = ARGV[a + 1 + i] end
  a = a + 2 + m
  for _ = 1, count do
    argv[1], argv[4] = ARGV[a], ARGV[a + 1]
    a = a + 2
    local r = op_admit_job(KEYS, argv)
    out[#out + 1] = r
    if r ~= 1 then plain = false end
  end
end
if plain then return 1 end
return out

-- update_mean: fold observations into an exponentially weighted mean, atomically.
-- KEYS[1]  the mean's key (a string holding a float)
-- ARGV[1]  the observation (float, e.g. seconds)
-- ARGV[2]  alpha, the weight of the new observation (0 < alpha <= 1)
-- ARGV[3]  TTL of the key in seconds (a tenant that stops running forgets its mean)
-- ARGV[4..] more observations, folded after ARGV[1] in order, each as its own call would
--          (the mean rounded to what the key stores between two), so one call carries a
--          worker's finished jobs of a tenant instead of one call each
-- Returns the new mean as a string.
local a = tonumber(ARGV[2])
local s = redis.call('GET', KEYS[1])
local m = tonumber(s)
local function fold(x)
  if m == nil then m = x else m = m + a * (x - m) end
  s = string.format('%.6f', m)
  m = tonumber(s)
end
fold(tonumber(ARGV[1]))
for i = 4, #ARGV do
  fold(tonumber(ARGV[i]))
end
redis.call('SET', KEYS[1], s, 'EX', tonumber(ARGV[3]))
return s

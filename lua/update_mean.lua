-- update_mean: fold one observation into an exponentially weighted mean, atomically.
-- KEYS[1]  the mean's key (a string holding a float)
-- ARGV[1]  the observation (float, e.g. seconds)
-- ARGV[2]  alpha, the weight of the new observation (0 < alpha <= 1)
-- ARGV[3]  TTL of the key in seconds (a tenant that stops running forgets its mean)
-- Returns the new mean as a string.
local x = tonumber(ARGV[1])
local m = tonumber(redis.call('GET', KEYS[1]))
if m == nil then m = x else m = m + tonumber(ARGV[2]) * (x - m) end
local s = string.format('%.6f', m)
redis.call('SET', KEYS[1], s, 'EX', tonumber(ARGV[3]))
return s

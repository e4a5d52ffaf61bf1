-- broker_pull: take, without blocking, the message a worker's fetch would take next
-- (fairqueue.jobs.broker.delivery_pull). kombu's Redis transport fetches with one BRPOP over
-- one list per (queue, priority step), in order; this pops from the first of those lists
-- that holds a message, from the same end BRPOP pops, so it takes what BRPOP would have.
-- KEYS     the lists, in the worker's fetch order (with kombu's global key prefix)
-- Returns {index of the list in KEYS (1-based), message} or false when every list is empty.
for i = 1, #KEYS do
  local message = redis.call('RPOP', KEYS[i])
  if message then
    return {i, message}
  end
end
return false

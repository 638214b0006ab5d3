-- Over-sampling: may this scored group be delivered? Yes while fewer than the job's `deliver`
-- groups were picked (or when it was picked already: a redelivery); the pick that fills the
-- quota cancels the job, so its other groups end `cancelled` and running ones are aborted, and
-- marks it cut: it delivered all it was asked, so it ends `done` (finish.lua), not `cancelled`.
-- KEYS: picked hash, job.  ARGV: group index, deliver, ttl (s).
-- Returns 1 (deliver it) or 0 (cancel it).
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return 1
end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], 1)
redis.call('EXPIRE', KEYS[1], ARGV[3])
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[2]) and redis.call('HGET', KEYS[2], JOB_STATE) == STATE_PENDING then
  redis.call('HSET', KEYS[2], JOB_STATE, STATE_CANCELLED, JOB_CUT, 1)
end
return 1

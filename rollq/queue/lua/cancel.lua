-- Mark a job cancelled: workers end its groups that have no result yet as `cancelled`.
-- KEYS: job.  Returns groups without a result, or -1 if the job does not exist.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
local groups = tonumber(redis.call('HGET', KEYS[1], JOB_GROUPS))
local done = tonumber(redis.call('HGET', KEYS[1], JOB_DONE))
if done < groups then
  redis.call('HSET', KEYS[1], JOB_STATE, STATE_CANCELLED)
end
return groups - done

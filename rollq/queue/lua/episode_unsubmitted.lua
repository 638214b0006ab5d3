-- Free a running turn whose job was never queued (its trainer died, or its submit failed, between
-- episode_start / episode_turn and the enqueue): the branches become idle with the reason. A job
-- that was queued after all (its record exists) is left to its result.
-- KEYS: episodes set, the turn's job record, then the branch records.  ARGV: turn job, reason.
-- Returns the number of branches freed.
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
local freed = 0
for i = 3, #KEYS do
  local found = redis.call('HMGET', KEYS[i], EPISODE_TURN_JOB, EPISODE_STATE, EPISODE_TTL)
  if found[1] == ARGV[1] then
    redis.call('HSET', KEYS[i], EPISODE_TURN_JOB, '', EPISODE_REASON, ARGV[2])
    if found[2] == EPISODE_IS_RUNNING then
      redis.call('HSET', KEYS[i], EPISODE_STATE, EPISODE_IS_IDLE)
      redis.call('ZADD', KEYS[1], redis.call('TIME')[1] + found[3], KEYS[i])
    end
    redis.call('EXPIRE', KEYS[i], found[3])
    freed = freed + 1
  end
end
return freed

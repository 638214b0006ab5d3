-- Write the one terminal result of a work entry, if the caller still owns it (fencing).
-- KEYS: work stream, result stream, job, done hash, errors hash, dead-letter stream,
--       outstanding-bytes counter (the raw item's bytes leave it with the entry; optional)
-- ARGV: consumer, entry id, group index ('' when unknown), status, result payload, job ttl (s),
--       dead-letter reason ('' for none), raw item (kept in the dead letter)
-- Returns REPLY_OK, REPLY_DUP (the group already had its result: entry dropped) or REPLY_LOST
-- (not ours).
local pending = redis.call('XPENDING', KEYS[1], GROUP_WORKERS, ARGV[2], ARGV[2], 1)
if #pending == 0 or pending[1][2] ~= ARGV[1] then
  return REPLY_LOST
end
redis.call('XACK', KEYS[1], GROUP_WORKERS, ARGV[2])
-- Consumed entries are deleted rather than trimmed: nothing pending is ever cut away.
redis.call('XDEL', KEYS[1], ARGV[2])
if KEYS[7] and redis.call('DECRBY', KEYS[7], #ARGV[8]) < 0 then
  redis.call('SET', KEYS[7], 0)
end
redis.call('HDEL', KEYS[5], ARGV[2])
if ARGV[7] ~= '' then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', 100000, '*', DEAD_STREAM, KEYS[1], DEAD_ID, ARGV[2],
    DEAD_REASON, ARGV[7], DEAD_ITEM, ARGV[8])
end
if ARGV[3] ~= '' and redis.call('EXISTS', KEYS[3]) == 1 then
  if redis.call('HSETNX', KEYS[4], ARGV[3], ARGV[4]) == 0 then
    return REPLY_DUP
  end
  redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
  local done = redis.call('HINCRBY', KEYS[3], JOB_DONE, 1)
  if done >= tonumber(redis.call('HGET', KEYS[3], JOB_GROUPS)) then
    if redis.call('HGET', KEYS[3], JOB_STATE) == STATE_PENDING then
      redis.call('HSET', KEYS[3], JOB_STATE, STATE_DONE)
    end
    redis.call('HSET', KEYS[3], JOB_FINISHED_AT, redis.call('TIME')[1])
    redis.call('EXPIRE', KEYS[3], ARGV[6])
    redis.call('EXPIRE', KEYS[4], ARGV[6])
  end
end
redis.call('XADD', KEYS[2], '*', RESULT_RESULT, ARGV[5])
return REPLY_OK

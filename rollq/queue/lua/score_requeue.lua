-- Dynamic sampling: a scored group whose rewards were all equal goes back to its trainer's work
-- stream to be generated again, if the caller still owns its scoring entry (fencing).
-- KEYS: scoring stream, work stream, errors hash, trainers set, outstanding-bytes counter, job.
-- ARGV: consumer, scoring entry id, trainer, job id, group index, the WorkItem to queue.
-- Returns REPLY_OK or REPLY_LOST (not ours: nothing changed).
local pending = redis.call('XPENDING', KEYS[1], GROUP_WORKERS, ARGV[2], ARGV[2], 1)
if #pending == 0 or pending[1][2] ~= ARGV[1] then
  return REPLY_LOST
end
redis.call('XACK', KEYS[1], GROUP_WORKERS, ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.pcall('XGROUP', 'CREATE', KEYS[2], GROUP_WORKERS, '0', 'MKSTREAM')
redis.call('XADD', KEYS[2], '*', WORK_JOB, ARGV[4], WORK_GROUP, ARGV[5], WORK_ITEM, ARGV[6])
redis.call('INCRBY', KEYS[5], #ARGV[6])
redis.call('SADD', KEYS[4], ARGV[3])
if redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('HINCRBY', KEYS[6], JOB_RESAMPLED, 1)
end
return REPLY_OK

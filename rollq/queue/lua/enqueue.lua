-- Submit one job: its record and one work entry per group, atomically, in one round trip.
-- KEYS: job, work stream, trainers set, outstanding counter, quotas hash, bounded-jobs set
-- ARGV: trainer, client quota, groups, created_at, deadline, meta, job_id, min_version,
--       max_version ('' for none), item1..itemN
-- Returns {'ok'}, {'dup'} (this job_id exists: idempotent submit) or {'full', outstanding, quota}.
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- A write (of nothing), so that a WAIT after a repeated submit covers the job's record too.
  redis.call('INCRBY', KEYS[4], 0)
  return {'dup'}
end
local groups = tonumber(ARGV[3])
local quota = tonumber(ARGV[2])
local cap = redis.call('HGET', KEYS[5], ARGV[1])
if cap and tonumber(cap) < quota then
  quota = tonumber(cap)
end
local outstanding = tonumber(redis.call('GET', KEYS[4]) or '0')
if outstanding + groups > quota then
  return {'full', outstanding, quota}
end
-- '0' so that entries added before any worker starts are still delivered; BUSYGROUP is fine.
redis.pcall('XGROUP', 'CREATE', KEYS[2], 'workers', '0', 'MKSTREAM')
redis.call('HSET', KEYS[1], 'trainer', ARGV[1], 'groups', groups, 'done', 0, 'ok', 0,
  'failed', 0, 'expired', 0, 'cancelled', 0, 'created_at', ARGV[4], 'deadline', ARGV[5],
  'meta', ARGV[6], 'state', 'pending', 'min_version', ARGV[8])
if ARGV[9] ~= '' then
  -- An upper bound may need old versions: retention looks here before deleting any.
  redis.call('HSET', KEYS[1], 'max_version', ARGV[9])
  redis.call('SADD', KEYS[6], KEYS[1])
end
for i = 1, groups do
  -- j and g repeat the payload's job and group so a malformed payload can still be named.
  redis.call('XADD', KEYS[2], '*', 'j', ARGV[7], 'g', i - 1, 'd', ARGV[9 + i])
end
redis.call('INCRBY', KEYS[4], groups)
redis.call('SADD', KEYS[3], ARGV[1])
return {'ok'}

-- Submit one job: its record and one work entry per group, atomically, in one round trip.
-- KEYS: job, work stream, trainers set, outstanding counter, the base trainer's cap, bounded-jobs
--       sorted set, outstanding-bytes counter, the base trainer's outstanding counter (KEYS[4] again for
--       a trainer that is its own base: a derived id's groups count against its base's quota)
-- ARGV: trainer, client quota, groups, created_at, deadline, meta, job_id, min_version,
--       max_version ('' for none), byte quota, routed ('1': the trainer's groups may also sit on
--       streams routed to workers), item1..itemN
-- Returns {REPLY_OK}, {REPLY_DUP} (this job_id exists: idempotent submit),
-- {REPLY_FULL, outstanding, quota} or {REPLY_BYTES, queued bytes, byte quota, this job's bytes}.
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- A write (of nothing), so that a WAIT after a repeated submit covers the job's record too.
  redis.call('INCRBY', KEYS[4], 0)
  return {REPLY_DUP}
end
local groups = tonumber(ARGV[3])
local quota = tonumber(ARGV[2])
local cap = redis.call('GET', KEYS[5])
if cap and tonumber(cap) < quota then
  quota = tonumber(cap)
end
local outstanding = tonumber(redis.call('GET', KEYS[8]) or '0')
if outstanding + groups > quota then
  return {REPLY_FULL, outstanding, quota}
end
local nbytes = 0
for i = 1, groups do
  nbytes = nbytes + #ARGV[11 + i]
end
-- Nothing in the stream means nothing queued or running: whatever the counter says is drift.
-- Not for a trainer with routed streams (episodes): its bytes may sit on its other streams, and
-- a reset would let it pass its quota.
if ARGV[11] ~= '1' and redis.call('XLEN', KEYS[2]) == 0 then
  redis.call('SET', KEYS[7], 0)
end
local queued = tonumber(redis.call('GET', KEYS[7]) or '0')
if queued + nbytes > tonumber(ARGV[10]) then
  return {REPLY_BYTES, queued, ARGV[10], nbytes}
end
-- '0' so that entries added before any worker starts are still delivered; BUSYGROUP is fine.
redis.pcall('XGROUP', 'CREATE', KEYS[2], GROUP_WORKERS, '0', 'MKSTREAM')
redis.call('HSET', KEYS[1], JOB_TRAINER, ARGV[1], JOB_GROUPS, groups, JOB_DONE, 0, JOB_OK, 0,
  JOB_FAILED, 0, JOB_EXPIRED, 0, JOB_CANCELLED, 0, JOB_FILTERED, 0, JOB_RESAMPLED, 0,
  JOB_CREATED_AT, ARGV[4], JOB_DEADLINE, ARGV[5], JOB_META, ARGV[6], JOB_STATE, STATE_PENDING,
  JOB_MIN_VERSION, ARGV[8])
if ARGV[9] ~= '' then
  -- An upper bound may need old versions: retention looks here before deleting any.
  redis.call('HSET', KEYS[1], JOB_MAX_VERSION, ARGV[9])
  local deadline = tonumber(ARGV[5])
  local added = redis.pcall('ZADD', KEYS[6], (deadline and deadline > 0) and deadline or '+inf', KEYS[1])
  if tonumber(added) == nil then  -- WRONGTYPE: a set left by an older rollq, until it empties
    redis.call('SADD', KEYS[6], KEYS[1])
  end
end
for i = 1, groups do
  -- j and g repeat the payload's job and group so a malformed payload can still be named.
  redis.call('XADD', KEYS[2], '*', WORK_JOB, ARGV[7], WORK_GROUP, i - 1, WORK_ITEM, ARGV[11 + i])
end
redis.call('INCRBY', KEYS[4], groups)
if KEYS[8] ~= KEYS[4] then
  redis.call('INCRBY', KEYS[8], groups)
end
redis.call('INCRBY', KEYS[7], nbytes)
redis.call('SADD', KEYS[3], ARGV[1])
return {REPLY_OK}

-- Deregister a version for retention, only if it is not the newest and no live lease pins it
-- (pin.lua). Whoever gets REPLY_OK owns the deletion of the version's files: concurrent retentions
-- never delete one version twice, and never one a worker pinned.
-- KEYS: versions hash, latest version, pins of the version.  ARGV: version.
-- Returns REPLY_OK, REPLY_NEWEST, REPLY_PINNED or REPLY_GONE (already removed by someone else).
if redis.call('GET', KEYS[2]) == ARGV[1] then
  return REPLY_NEWEST
end
local now = redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now[1] * 1000 + math.floor(now[2] / 1000))
if redis.call('ZCARD', KEYS[3]) > 0 then
  return REPLY_PINNED
end
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then
  return REPLY_GONE
end
return REPLY_OK

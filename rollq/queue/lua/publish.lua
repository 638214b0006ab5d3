-- Register a policy version: strictly above the newest one (compare-and-set), then announce it.
-- KEYS: versions hash, latest version.  ARGV: version, encoded entry, announcement channel.
-- Returns {'ok', previous latest} or {'stale', latest} (refused).
local latest = tonumber(redis.call('GET', KEYS[2]) or '-1')
if tonumber(ARGV[1]) <= latest then
  return {'stale', latest}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[1])
return {'ok', latest}

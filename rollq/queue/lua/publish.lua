-- Register a policy version: strictly above the newest one (compare-and-set), then announce it.
-- KEYS: versions hash, latest version, announcement stream.  ARGV: version, encoded entry.
-- Returns {REPLY_OK, previous latest} or {REPLY_STALE, latest} (refused).
local latest = tonumber(redis.call('GET', KEYS[2]) or '-1')
if tonumber(ARGV[1]) <= latest then
  return {REPLY_STALE, latest}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 1000, '*', EVENT_VERSION, ARGV[1])
return {REPLY_OK, latest}

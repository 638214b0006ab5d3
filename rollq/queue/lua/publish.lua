-- Register a policy version: strictly above the newest one (compare-and-set), then announce it.
-- KEYS: versions hash, latest version, announcement stream.  ARGV: version, encoded entry.
-- Returns {REPLY_OK, previous latest} or {REPLY_STALE, latest} (refused).
-- Idempotent: the client retries a call whose reply a dropped connection lost, so the same entry
-- (same bytes: path, files, time) registered already is this publish again, not a conflict;
-- refusing it would make the publisher delete the files of a registered version.
local latest = tonumber(redis.call('GET', KEYS[2]) or '-1')
if tonumber(ARGV[1]) <= latest then
  if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
    return {REPLY_OK, latest}
  end
  return {REPLY_STALE, latest}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', 1000, '*', EVENT_VERSION, ARGV[1])
return {REPLY_OK, latest}

-- Pin a version for a worker (a lease), only while the version is registered: retention's
-- retire.lua refuses a pinned version, so a worker that holds a pin never loses its files.
-- KEYS: versions hash, pins of the version.  ARGV: version, worker id, lease ms.
-- Returns the encoded VersionEntry, or false when the version is no longer registered.
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  return false
end
local now = redis.call('TIME')
local ms = tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], now[1] * 1000 + math.floor(now[2] / 1000) + ms, ARGV[2])
-- The set outlives its longest lease only: a crashed worker's pins disappear by themselves.
if redis.call('PTTL', KEYS[2]) < ms then
  redis.call('PEXPIRE', KEYS[2], ms)
end
return entry

-- Take over entries whose lease lapsed (or that were released), with their delivery counts.
-- KEYS: work stream, errors hash.  ARGV: consumer, min idle (ms), cursor, count.
-- Returns {next cursor, {{id, fields, deliveries, last error}, ...}}.
local claimed = redis.call('XAUTOCLAIM', KEYS[1], GROUP_WORKERS, ARGV[1], ARGV[2], ARGV[3],
  'COUNT', ARGV[4])
local out = {}
for _, entry in ipairs(claimed[2]) do
  local pending = redis.call('XPENDING', KEYS[1], GROUP_WORKERS, entry[1], entry[1], 1)
  local err = redis.call('HGET', KEYS[2], entry[1]) or ''
  table.insert(out, {entry[1], entry[2], pending[1][4], err})
end
return {claimed[1], out}

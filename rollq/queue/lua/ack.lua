-- A trainer acknowledges results it has consumed: they leave the stream and its quota.
-- KEYS: result stream, outstanding counter.  ARGV: id1..idN.  Returns the number acked.
local acked = redis.call('XACK', KEYS[1], 'trainer', unpack(ARGV))
if acked > 0 then
  redis.call('XDEL', KEYS[1], unpack(ARGV))
  if redis.call('DECRBY', KEYS[2], acked) < 0 then
    redis.call('SET', KEYS[2], 0)
  end
end
return acked

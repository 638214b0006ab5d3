-- Forget a routed work stream that nothing was routed to since ARGV[2] and that holds no entry.
-- KEYS: routed hash, the stream.  ARGV: the stream's name, cutoff (unix s).
-- Returns REPLY_OK when it was removed, else REPLY_DUP (still in use).
local at = redis.call('HGET', KEYS[1], ARGV[1])
if at and tonumber(at) >= tonumber(ARGV[2]) then
  return REPLY_DUP
end
if redis.call('EXISTS', KEYS[2]) == 1 and redis.call('XLEN', KEYS[2]) > 0 then
  return REPLY_DUP
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return REPLY_OK

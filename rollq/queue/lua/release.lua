-- Hand entries the caller owns back to the pool, claimable by anyone at once.
-- KEYS: work stream, errors hash.
-- ARGV: consumer, error ('' for none), refund (1: this delivery does not count), id1..idN
-- Returns the number released.
local released = 0
if redis.call('EXISTS', KEYS[1]) == 0 then  -- emptied and pruned (trainer_prune.lua): none is ours
  return 0
end
for i = 4, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], GROUP_WORKERS, ARGV[i], ARGV[i], 1)
  if #pending == 1 and pending[1][2] == ARGV[1] then
    local deliveries = pending[1][4]
    if ARGV[3] == '1' and deliveries > 0 then
      deliveries = deliveries - 1
    end
    -- A huge IDLE makes the entry look long lapsed, so the next reclaim takes it.
    redis.call('XCLAIM', KEYS[1], GROUP_WORKERS, GROUP_RELEASED, 0, ARGV[i], 'IDLE', 1000000000000,
      'RETRYCOUNT', deliveries, 'JUSTID')
    if ARGV[2] ~= '' then
      redis.call('HSET', KEYS[2], ARGV[i], ARGV[2])
    end
    released = released + 1
  end
end
return released

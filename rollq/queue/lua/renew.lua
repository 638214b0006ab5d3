-- Extend the lease of the entries the caller holds; report those it no longer owns.
-- KEYS: work stream.  ARGV: consumer, id1..idN.  Returns the ids that were lost.
local lost = {}
if redis.call('EXISTS', KEYS[1]) == 0 then  -- emptied and pruned (trainer_prune.lua): none is ours
  for i = 2, #ARGV do
    table.insert(lost, ARGV[i])
  end
  return lost
end
for i = 2, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], GROUP_WORKERS, ARGV[i], ARGV[i], 1)
  if #pending == 1 and pending[1][2] == ARGV[1] then
    -- JUSTID: resets the idle time without counting another delivery.
    redis.call('XCLAIM', KEYS[1], GROUP_WORKERS, ARGV[1], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost

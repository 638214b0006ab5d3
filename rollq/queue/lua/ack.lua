-- A trainer acknowledges results it has consumed: they leave the stream and its quota.
-- KEYS: result stream, outstanding counter[, the base trainer's outstanding counter (a derived
-- id's results leave its base's quota too)].  ARGV: id1..idN.  Returns the number acked.
-- Per id: only an entry XACK took out of the pending list is deleted and leaves the quota. An id
-- that was never read (or was acked already) is left alone; deleting it would lose its result and
-- leak its quota, since nobody could read it again to acknowledge it.
local acked = 0
for _, id in ipairs(ARGV) do
  if redis.call('XACK', KEYS[1], GROUP_TRAINER, id) == 1 then
    redis.call('XDEL', KEYS[1], id)
    acked = acked + 1
  end
end
for k = 2, #KEYS do
  if acked > 0 and redis.call('DECRBY', KEYS[k], acked) < 0 then
    redis.call('SET', KEYS[k], 0)
  end
end
return acked

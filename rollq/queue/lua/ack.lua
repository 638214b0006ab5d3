-- A trainer acknowledges results it has consumed: they leave the stream and its quota.
-- KEYS: result stream, outstanding counter[, the base trainer's outstanding counter (a derived
-- id's results leave its base's quota too)].  ARGV: id1..idN.  Returns the number acked.
-- Per id: only an entry XACK took out of the pending list is deleted and leaves the quota. An id
-- that was never read (or was acked already) is left alone; deleting it would lose its result and
-- leak its quota, since nobody could read it again to acknowledge it.
local taken = {}
for _, id in ipairs(ARGV) do
  if redis.call('XACK', KEYS[1], GROUP_TRAINER, id) == 1 then
    taken[#taken + 1] = id
  end
end
-- One XDEL for them all: one per id cost Redis twice as much per entry (docs/benchmarks.md,
-- "Issue 43, dispatch"). At most ACK_CHUNK ids a call, within Lua's unpack limit.
local acked = #taken
if acked > 0 then
  redis.call('XDEL', KEYS[1], unpack(taken))
end
for k = 2, #KEYS do
  if acked > 0 and redis.call('DECRBY', KEYS[k], acked) < 0 then
    redis.call('SET', KEYS[k], 0)
  end
end
return acked

-- Retention of results nobody reads: a result stream nothing was written to since the cutoff is
-- deleted with what it still holds (results never acknowledged: their reader is gone, e.g. an
-- `Episodes` object with a fresh owner that was never recovered), and those results leave the
-- trainer's quota, so a reader that vanished cannot hold its trainer's quota for good.
-- KEYS: result-streams sorted set, the result stream, its trainer's outstanding counter, its base
--       trainer's outstanding counter (the same key for a trainer that is its own base).
-- ARGV: the result stream's name, cutoff (unix s).
-- Returns the results dropped, or -1 when the stream was written to since (kept).
local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
if at and tonumber(at) >= tonumber(ARGV[2]) then
  return -1
end
local dropped = 0
if redis.call('EXISTS', KEYS[2]) == 1 then
  dropped = redis.call('XLEN', KEYS[2])
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
local counters = {KEYS[3]}
if KEYS[4] ~= KEYS[3] then
  counters[2] = KEYS[4]
end
for _, counter in ipairs(counters) do
  -- A count that is no number (set by the trainer's own Redis user) is dropped, not fatal.
  local ok, left = pcall(redis.call, 'DECRBY', counter, dropped)
  if not ok or left <= 0 then
    redis.call('DEL', counter)
  end
end
return dropped

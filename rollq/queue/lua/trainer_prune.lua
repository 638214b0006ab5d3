-- Forget trainers with nothing queued: each leaves the trainers set (workers read every member's
-- stream on every claim) and its empty keys go, so neither claims nor memory grow with the number
-- of trainers ever seen. Its next submit puts it back (enqueue.lua).
-- KEYS: trainers set, then per trainer: its work stream, result stream, outstanding counter,
--       outstanding-bytes counter.
-- ARGV: trainer1..trainerN.
-- Returns the trainers removed.

-- Nothing in it and nothing pending (an entry deleted while pending would leave its id there).
local function empty(stream, group)
  if redis.call('EXISTS', stream) == 0 then
    return true
  end
  if redis.call('XLEN', stream) > 0 then
    return false
  end
  local ok, summary = pcall(redis.call, 'XPENDING', stream, group)
  return not ok or summary[1] == 0
end

local removed = {}
for i = 1, #ARGV do
  local k = 2 + (i - 1) * 4
  local work, results, outstanding, nbytes = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  if empty(work, GROUP_WORKERS) then
    redis.call('SREM', KEYS[1], ARGV[i])
    redis.call('DEL', work)
    -- Keys that hold nothing: results all acknowledged, counters at zero.
    if empty(results, GROUP_TRAINER) then
      redis.call('DEL', results)
    end
    -- (A count that is no number was set by the trainer's own Redis user: it is not kept.)
    if (tonumber(redis.call('GET', outstanding) or '0') or 0) <= 0 then
      redis.call('DEL', outstanding)
    end
    if (tonumber(redis.call('GET', nbytes) or '0') or 0) <= 0 then
      redis.call('DEL', nbytes)
    end
    removed[#removed + 1] = ARGV[i]
  end
end
return removed

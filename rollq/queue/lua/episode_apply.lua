-- End a running turn: append what it added to each branch (served) or record why not (failed),
-- and make the branch idle again. Idempotent: a branch whose running turn is not this job
-- (applied already, or never this one's) is left alone; so is an ended branch (ended while the
-- turn ran: end() returned its record, which does not change after).
-- KEYS: episodes set, then the branch records.
-- ARGV: turn job, then 9 per branch: served ('1' or '0'), version, worker,
--       reason, tokens, mask, logprobs, token versions (the turn's new and sampled tokens),
--       the turn as its caller gets it (kept to answer the turn sent again).
-- Returns the number of branches the turn extended or recorded as failed. A served turn found
-- applied already (the same call sent again after its reply was lost) counts as extended, so the
-- caller is answered as the first run would have answered it.
local changed = 0
for i = 2, #KEYS do
  local at = 1 + (i - 2) * 9
  local found = redis.call('HMGET', KEYS[i], EPISODE_TURN_JOB, EPISODE_STATE, EPISODE_TTL,
    EPISODE_LAST_TURN_JOB)
  if found[1] ~= ARGV[1] and found[4] == ARGV[1] and ARGV[at + 1] == '1' then
    changed = changed + 1
  elseif found[1] == ARGV[1] and found[2] == EPISODE_IS_ENDED then
    redis.call('HSET', KEYS[i], EPISODE_TURN_JOB, '')
  elseif found[1] == ARGV[1] then
    if ARGV[at + 1] == '1' then
      local now = redis.call('HMGET', KEYS[i], EPISODE_TOKENS, EPISODE_MASK, EPISODE_LOGPROBS,
        EPISODE_TOKEN_VERSIONS)
      redis.call('HSET', KEYS[i], EPISODE_TOKENS, now[1] .. ARGV[at + 5],
        EPISODE_MASK, now[2] .. ARGV[at + 6], EPISODE_LOGPROBS, now[3] .. ARGV[at + 7],
        EPISODE_TOKEN_VERSIONS, now[4] .. ARGV[at + 8], EPISODE_VERSION, ARGV[at + 2],
        EPISODE_WORKER, ARGV[at + 3], EPISODE_REASON, '', EPISODE_LAST_TURN_JOB, ARGV[1],
        EPISODE_LAST_TURN, ARGV[at + 9])
      redis.call('HINCRBY', KEYS[i], EPISODE_TURNS, 1)
    else
      redis.call('HSET', KEYS[i], EPISODE_REASON, ARGV[at + 4])
    end
    redis.call('HSET', KEYS[i], EPISODE_TURN_JOB, '')
    if found[2] == EPISODE_IS_RUNNING then
      redis.call('HSET', KEYS[i], EPISODE_STATE, EPISODE_IS_IDLE)
      redis.call('ZADD', KEYS[1], redis.call('TIME')[1] + found[3], KEYS[i])
    end
    redis.call('EXPIRE', KEYS[i], found[3])
    changed = changed + 1
  end
end
return changed

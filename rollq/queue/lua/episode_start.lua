-- Start an episode of n branches, each a record whose first turn is running (the job ARGV[8]).
-- KEYS: episodes set, then the n branch records.
-- ARGV: trainer, sampling, min_version, max_version, max_staleness, move, ttl, turn job,
--       created_at, tokens, mask, logprobs, token versions (the prompt's), submitter.
-- Returns REPLY_OK, or REPLY_DUP when a branch exists (the episode id is taken).
-- Idempotent: the client retries a call whose reply a dropped connection lost; branches this very
-- call made (same trainer, first turn job and created_at) are its own, not a taken id.
local mine = redis.call('HMGET', KEYS[2], EPISODE_TRAINER, EPISODE_TURN_JOB, EPISODE_CREATED_AT)
if mine[1] == ARGV[1] and mine[2] == ARGV[8] and mine[3] == ARGV[9] then
  return REPLY_OK
end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    return REPLY_DUP
  end
end
for i = 2, #KEYS do
  redis.call('HSET', KEYS[i], EPISODE_TRAINER, ARGV[1], EPISODE_STATE, EPISODE_IS_RUNNING,
    EPISODE_SAMPLING, ARGV[2], EPISODE_MIN_VERSION, ARGV[3], EPISODE_MAX_VERSION, ARGV[4],
    EPISODE_MAX_STALENESS, ARGV[5], EPISODE_MOVE, ARGV[6], EPISODE_TTL, ARGV[7],
    EPISODE_TURN_JOB, ARGV[8], EPISODE_CREATED_AT, ARGV[9], EPISODE_VERSION, '',
    EPISODE_TOKENS, ARGV[10], EPISODE_MASK, ARGV[11], EPISODE_LOGPROBS, ARGV[12],
    EPISODE_TOKEN_VERSIONS, ARGV[13], EPISODE_TURNS, 0, EPISODE_WORKER, '', EPISODE_REASON, '',
    EPISODE_SUBMITTER, ARGV[14])
  redis.call('EXPIRE', KEYS[i], ARGV[7])
  redis.call('ZADD', KEYS[1], redis.call('TIME')[1] + ARGV[7], KEYS[i])
end
return REPLY_OK

-- Begin a turn: an idle episode of this trainer becomes running, its turn job named.
-- KEYS: the episode record, episodes set.  ARGV: trainer, turn job, submitter.
-- Returns {REPLY_OK, tokens, version, turns, sampling, min_version, max_version, max_staleness,
-- move, worker} (read in this call: a start or turn applied just before cannot be half seen),
-- {REPLY_DUP, last turn} (this turn job was served already: a turn sent again),
-- {REPLY_GONE} (unknown, expired or another
-- trainer's), {REPLY_BUSY, the running turn's job} or {REPLY_ENDED}.
-- Idempotent: the client retries a call whose reply a dropped connection lost; a running turn
-- that is this very call's job (a fresh id per call) answers as the call did.
local found = redis.call('HMGET', KEYS[1], EPISODE_TRAINER, EPISODE_STATE, EPISODE_TURN_JOB,
  EPISODE_TTL, EPISODE_LAST_TURN_JOB)
if found[1] ~= ARGV[1] then
  return {REPLY_GONE}
end
if found[5] == ARGV[2] then
  return {REPLY_DUP, redis.call('HGET', KEYS[1], EPISODE_LAST_TURN)}
end
if found[2] == EPISODE_IS_ENDED then
  return {REPLY_ENDED}
end
if found[2] == EPISODE_IS_RUNNING and found[3] ~= ARGV[2] then
  return {REPLY_BUSY, found[3]}
end
redis.call('HSET', KEYS[1], EPISODE_STATE, EPISODE_IS_RUNNING, EPISODE_TURN_JOB, ARGV[2],
  EPISODE_SUBMITTER, ARGV[3])
redis.call('EXPIRE', KEYS[1], found[4])
redis.call('ZADD', KEYS[2], redis.call('TIME')[1] + found[4], KEYS[1])
local now = redis.call('HMGET', KEYS[1], EPISODE_TOKENS, EPISODE_VERSION, EPISODE_TURNS,
  EPISODE_SAMPLING, EPISODE_MIN_VERSION, EPISODE_MAX_VERSION, EPISODE_MAX_STALENESS, EPISODE_MOVE,
  EPISODE_WORKER)
return {REPLY_OK, now[1], now[2], now[3], now[4], now[5], now[6], now[7], now[8], now[9]}

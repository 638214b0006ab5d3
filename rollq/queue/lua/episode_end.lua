-- End an episode: no more turns, and its version is no longer kept for it. A turn running now is
-- discarded when it finishes (episode_apply leaves an ended record as this call left it).
-- KEYS: the episode record, episodes set.  ARGV: trainer.
-- Returns REPLY_OK, REPLY_ENDED (ended before) or REPLY_GONE (unknown, expired, another's).
local found = redis.call('HMGET', KEYS[1], EPISODE_TRAINER, EPISODE_STATE)
if found[1] ~= ARGV[1] then
  return REPLY_GONE
end
redis.call('ZREM', KEYS[2], KEYS[1])
if found[2] == EPISODE_IS_ENDED then
  return REPLY_ENDED
end
redis.call('HSET', KEYS[1], EPISODE_STATE, EPISODE_IS_ENDED)
return REPLY_OK

-- The bytes a trainer's conversation records hold, once the records that expired are let go.
-- KEYS: the trainer's holds (sorted set: conversation id -> expiry, unix s), their bytes (hash:
--       id -> bytes, CONVERSATION_BYTES_TOTAL -> their sum).
-- Returns the bytes held. conversation_append.lua lets expired holds go the same way.
local now = tonumber(redis.call('TIME')[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  local freed = 0
  for _, id in ipairs(expired) do
    freed = freed + tonumber(redis.call('HGET', KEYS[2], id) or '0')
    redis.call('HDEL', KEYS[2], id)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HINCRBY', KEYS[2], CONVERSATION_BYTES_TOTAL, -freed)
end
return tonumber(redis.call('HGET', KEYS[2], CONVERSATION_BYTES_TOTAL) or '0')

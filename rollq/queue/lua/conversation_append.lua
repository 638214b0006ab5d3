-- Append one served chat turn to an agent conversation's record, within the trainer's byte
-- budget for conversation records. Idempotent on the turn's job id: a turn sent again (its reply
-- lost) is not appended twice.
-- KEYS: the record, the trainer's holds (sorted set: conversation id -> expiry, unix s), their
--       bytes (hash: id -> the record's bytes, CONVERSATION_BYTES_TOTAL -> their sum).
-- ARGV: job id, the exact prefix's token count the turn's prompt begins with ('-1': it was
--       rendered whole), prompt (int32), sampled tokens (int32), their logprobs (float32), their
--       versions (int32), drift ('1' or '0'), the messages (msgpack), the turn (length-prefixed
--       msgpack), ttl (s), the conversation id, the budget (bytes), the request's key, its reply.
-- Returns {REPLY_OK}, {REPLY_DUP} or {REPLY_BYTES, bytes the other records hold, bytes this
-- record would hold} (over the budget: nothing written).
-- The turn continues the record's last segment when its prompt begins with exactly that
-- segment's tokens; else it begins a segment: '0' rendered whole (history edited), '2' it
-- continued the segment as it was, but another turn was appended since (it was overtaken).
-- A record's hold expires with it (`ttl` after its last turn, on Redis's clock); expired holds
-- are let go here and in conversation_held.lua, so the budget counts what Redis holds.
local space = string.char(32)
local jobs = redis.call('HGET', KEYS[1], CONVERSATION_JOBS) or ''
if string.find(jobs, space .. ARGV[1] .. space, 1, true) then
  return {REPLY_DUP}
end
local now, ttl, id, budget = tonumber(redis.call('TIME')[1]), tonumber(ARGV[10]), ARGV[11], tonumber(ARGV[12])
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
if #expired > 0 then
  local freed = 0
  for _, gone in ipairs(expired) do
    freed = freed + tonumber(redis.call('HGET', KEYS[3], gone) or '0')
    redis.call('HDEL', KEYS[3], gone)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  redis.call('HINCRBY', KEYS[3], CONVERSATION_BYTES_TOTAL, -freed)
end
local now_fields = redis.call('HMGET', KEYS[1], CONVERSATION_TOKENS, CONVERSATION_MASK, CONVERSATION_LOGPROBS,
  CONVERSATION_TOKEN_VERSIONS, CONVERSATION_SEGMENT_START, CONVERSATION_TURNS, CONVERSATION_DRIFT)
local tokens = now_fields[1] or ''
local start = tonumber(now_fields[5] or '0')
local prefix = tonumber(ARGV[2])
local prompt = ARGV[3]
local segment = string.sub(tokens, start * 4 + 1)
local added, flag, segment_start = prompt, '0', start
if prefix > 0 and prefix * 4 == #segment and string.sub(prompt, 1, #segment) == segment then
  added, flag = string.sub(prompt, #segment + 1), '1'
else
  if prefix > 0 then
    flag = '2'
  end
  segment_start = #tokens / 4
end
local drift = tonumber(now_fields[7] or '0') + tonumber(ARGV[7])
-- Not sampled: mask 0, logprob NaN (float32), version -1 (int32).
local fresh = #added / 4
local sampled = #ARGV[4] / 4
local fields = {
  CONVERSATION_TOKENS, tokens .. added .. ARGV[4],
  CONVERSATION_MASK, (now_fields[2] or '') .. string.rep(string.char(0), fresh) .. string.rep(string.char(1), sampled),
  CONVERSATION_LOGPROBS, (now_fields[3] or '') .. string.rep(string.char(0, 0, 192, 127), fresh) .. ARGV[5],
  CONVERSATION_TOKEN_VERSIONS, (now_fields[4] or '') .. string.rep(string.char(255, 255, 255, 255), fresh) .. ARGV[6],
  CONVERSATION_SEGMENT_START, tostring(segment_start), CONVERSATION_MESSAGES, ARGV[8],
  CONVERSATION_TURNS, (now_fields[6] or '') .. flag .. ARGV[9], CONVERSATION_JOBS, jobs .. space .. ARGV[1] .. space,
  CONVERSATION_DRIFT, tostring(drift), CONVERSATION_REQUEST, ARGV[13], CONVERSATION_REPLY, ARGV[14]}
local size = 0
for i = 1, #fields do
  size = size + #fields[i]
end
local before = tonumber(redis.call('HGET', KEYS[3], id) or '0')
local others = tonumber(redis.call('HGET', KEYS[3], CONVERSATION_BYTES_TOTAL) or '0') - before
if others + size > budget then
  return {REPLY_BYTES, others, size}
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now + ttl, id)
redis.call('HSET', KEYS[3], id, size)
redis.call('HINCRBY', KEYS[3], CONVERSATION_BYTES_TOTAL, size - before)
for k = 2, 3 do
  if redis.call('TTL', KEYS[k]) < ttl then
    redis.call('EXPIRE', KEYS[k], ttl)
  end
end
return {REPLY_OK}

-- Append one served chat turn to an agent conversation's record. Idempotent on the turn's job id:
-- a turn sent again (its reply lost) is not appended twice.
-- KEYS: the record.
-- ARGV: job id, the exact prefix's token count the turn's prompt begins with ('-1': it was
--       rendered whole), prompt (int32), sampled tokens (int32), their logprobs (float32), their
--       versions (int32), drift ('1' or '0'), the messages (msgpack), the turn (length-prefixed
--       msgpack), ttl (s).
-- The turn continues the record's last segment when its prompt begins with exactly that
-- segment's tokens; else (history edited, or another turn came between) it begins a segment.
local space = string.char(32)
local jobs = redis.call('HGET', KEYS[1], CONVERSATION_JOBS) or ''
if string.find(jobs, space .. ARGV[1] .. space, 1, true) then
  return REPLY_DUP
end
local now = redis.call('HMGET', KEYS[1], CONVERSATION_TOKENS, CONVERSATION_MASK, CONVERSATION_LOGPROBS,
  CONVERSATION_TOKEN_VERSIONS, CONVERSATION_SEGMENT_START, CONVERSATION_TURNS)
local tokens = now[1] or ''
local start = tonumber(now[5] or '0')
local prefix = tonumber(ARGV[2])
local prompt = ARGV[3]
local segment = string.sub(tokens, start * 4 + 1)
local added, flag = prompt, '0'
if prefix > 0 and prefix * 4 == #segment and string.sub(prompt, 1, #segment) == segment then
  added, flag = string.sub(prompt, #segment + 1), '1'
  if ARGV[7] == '1' then
    redis.call('HINCRBY', KEYS[1], CONVERSATION_DRIFT, 1)
  end
else
  redis.call('HSET', KEYS[1], CONVERSATION_SEGMENT_START, #tokens / 4)
end
-- Not sampled: mask 0, logprob NaN (float32), version -1 (int32).
local fresh = #added / 4
local sampled = #ARGV[4] / 4
redis.call('HSET', KEYS[1], CONVERSATION_TOKENS, tokens .. added .. ARGV[4],
  CONVERSATION_MASK, (now[2] or '') .. string.rep(string.char(0), fresh) .. string.rep(string.char(1), sampled),
  CONVERSATION_LOGPROBS, (now[3] or '') .. string.rep(string.char(0, 0, 192, 127), fresh) .. ARGV[5],
  CONVERSATION_TOKEN_VERSIONS, (now[4] or '') .. string.rep(string.char(255, 255, 255, 255), fresh) .. ARGV[6],
  CONVERSATION_MESSAGES, ARGV[8], CONVERSATION_TURNS, (now[6] or '') .. flag .. ARGV[9],
  CONVERSATION_JOBS, jobs .. space .. ARGV[1] .. space)
redis.call('EXPIRE', KEYS[1], ARGV[10])
return REPLY_OK

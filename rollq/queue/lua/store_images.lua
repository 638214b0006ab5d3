-- Store a submit's images once per content, within the trainer's image budget.
-- KEYS: the trainer's image holds (sorted set: digest .. bytes -> expiry, unix s), the bytes they
--       hold (counter), then one image key per image (the trainer's own: `Keys.image`).
-- ARGV: ttl (s), budget (bytes), then per image its digest (64 hex characters) and its bytes
--       ('' for a reference to an image stored before).
-- Returns {REPLY_OK, bytes written}, {REPLY_GONE, digest} (a reference to an image Redis no
-- longer holds) or {REPLY_BYTES, bytes held, bytes this call adds} (over the budget).
-- A trainer's budget counts every distinct image it stored or named until its hold expires
-- (`ttl` after the last submit naming it), whoever stored it first: Redis holds at most the sum
-- of the budgets. Idempotent: a call sent again (its reply lost) holds nothing twice.
-- Holds expire on Redis's clock, as the keys' TTLs do: a client whose clock lags would drop
-- holds of images Redis still stores (and store more than its budget); one ahead, the reverse.
local now, ttl, budget = tonumber(redis.call('TIME')[1]), tonumber(ARGV[1]), tonumber(ARGV[2])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  local freed = 0
  for _, member in ipairs(expired) do
    freed = freed + tonumber(string.sub(member, 65))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('DECRBY', KEYS[2], freed)
end
local held = tonumber(redis.call('GET', KEYS[2]) or '0')
local members, added = {}, 0
for i = 3, #KEYS do
  local digest, data = ARGV[2 * i - 3], ARGV[2 * i - 2]
  local size = #data
  if size == 0 then
    size = redis.call('STRLEN', KEYS[i])
    if size == 0 then
      return {REPLY_GONE, digest}
    end
  end
  members[i] = digest .. size
  if not redis.call('ZSCORE', KEYS[1], members[i]) then
    added = added + size
  end
end
if held + added > budget then
  return {REPLY_BYTES, held, added}
end
local written = 0
for i = 3, #KEYS do
  local data = ARGV[2 * i - 2]
  if #data > 0 and redis.call('SET', KEYS[i], data, 'NX', 'EX', ttl) then
    written = written + #data
  end
  redis.call('EXPIRE', KEYS[i], ttl, 'GT')  -- extend, never shorten
  redis.call('ZADD', KEYS[1], 'GT', now + ttl, members[i])
end
redis.call('INCRBY', KEYS[2], added)
for k = 1, 2 do
  if redis.call('TTL', KEYS[k]) < ttl then
    redis.call('EXPIRE', KEYS[k], ttl)
  end
end
return {REPLY_OK, written}

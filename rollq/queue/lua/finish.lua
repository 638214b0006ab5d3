-- Write the one terminal result of each of a batch of work entries, each only if the caller still
-- owns it (fencing per entry: one entry lost or already done changes nothing for the others).
-- KEYS: errors hash, dead-letter stream, then every other key the batch touches, each once (work
--       streams, result streams, jobs, done hashes, outstanding-bytes counters)
-- ARGV: consumer, job ttl (s), the entries as one msgpack array (Redis' cmsgpack unpacks it: one
--       argument for the batch, where 12 per entry cost the worker more than the rest of a
--       no-op group), each entry an array of 12: the KEYS indices of its work stream, result
--       stream, job, done hash and outstanding-bytes counter (the raw item's bytes leave it with
--       the entry), then its entry id, group index ('' when unknown), status, result payload,
--       dead-letter reason ('' for none), the raw item's size in bytes, the raw item (kept in the
--       dead letter; '' when there is none: only its size travels)
-- Returns per entry REPLY_OK, REPLY_DUP (the group already had its result: entry dropped) or
-- REPLY_LOST (not ours).
local function finish(stream, results, job, done, nbytes, id, group, status, payload, reason, size, raw)
  local pending = redis.call('XPENDING', stream, GROUP_WORKERS, id, id, 1)
  if #pending == 0 or pending[1][2] ~= ARGV[1] then
    return REPLY_LOST
  end
  redis.call('XACK', stream, GROUP_WORKERS, id)
  -- Consumed entries are deleted rather than trimmed: nothing pending is ever cut away.
  redis.call('XDEL', stream, id)
  if redis.call('DECRBY', nbytes, size) < 0 then
    redis.call('SET', nbytes, 0)
  end
  redis.call('HDEL', KEYS[1], id)
  if reason ~= '' then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', 100000, '*', DEAD_STREAM, stream, DEAD_ID, id,
      DEAD_REASON, reason, DEAD_ITEM, raw)
  end
  if group ~= '' and redis.call('EXISTS', job) == 1 then
    if redis.call('HSETNX', done, group, status) == 0 then
      return REPLY_DUP
    end
    redis.call('HINCRBY', job, status, 1)
    local finished = redis.call('HINCRBY', job, JOB_DONE, 1)
    if finished >= tonumber(redis.call('HGET', job, JOB_GROUPS)) then
      if redis.call('HGET', job, JOB_STATE) == STATE_PENDING then
        redis.call('HSET', job, JOB_STATE, STATE_DONE)
      end
      redis.call('HSET', job, JOB_FINISHED_AT, redis.call('TIME')[1])
      redis.call('EXPIRE', job, ARGV[2])
      redis.call('EXPIRE', done, ARGV[2])
    end
  end
  redis.call('XADD', results, '*', RESULT_RESULT, payload)
  return REPLY_OK
end

local replies = {}
for i, e in ipairs(cmsgpack.unpack(ARGV[3])) do
  -- An error (a key of the wrong type, a job record without `groups`) fails its own entry, as
  -- when every entry was a script call of its own; what it wrote before the error stays.
  local ok, reply = pcall(finish, KEYS[e[1]], KEYS[e[2]], KEYS[e[3]], KEYS[e[4]], KEYS[e[5]],
    e[6], e[7], e[8], e[9], e[10], e[11], e[12])
  if not ok and not reply.err then
    reply = redis.error_reply(tostring(reply))
  end
  replies[i] = reply
end
return replies

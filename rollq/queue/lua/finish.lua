-- Write the one terminal result of each of a batch of work entries, each only if the caller still
-- owns it (fencing per entry: one entry lost or already done changes nothing for the others).
-- KEYS: errors hash, dead-letter stream, result-streams sorted set (when each result stream was
--       last written: their retention), results-written hash (entries written per stream: the
--       gateway's live rates), then every other key the batch touches, each once (work
--       streams, result streams, jobs, done hashes, outstanding-bytes counters)
-- ARGV: consumer, job ttl (s), the entries as one msgpack array (Redis' cmsgpack unpacks it: one
--       argument for the batch, where 12 per entry cost the worker more than the rest of a
--       no-op group), the key sets as another; each key set the KEYS indices of a work stream,
--       result stream, job, done hash and outstanding-bytes counter (the raw item's bytes leave
--       it with the entry); each entry an array: its key set's index, entry id, group index (''
--       when unknown), status, result payload, the raw item's size in bytes, and only for a dead
--       letter its reason and the raw item (kept in the dead letter). Unpacking cost Redis per
--       element: an entry's keys are one index, and an entry without a dead letter stops early.
-- Returns per entry REPLY_OK, REPLY_DUP (the group already had its result: entry dropped) or
-- REPLY_LOST (not ours).
--
-- In passes, which leave what finishing the entries one by one would (measured: redis.call
-- costs more than the command it runs, and per entry this script ran eleven, then six):
-- 1. per entry: fencing (reads only);
-- 2. per stream, per counter, per batch: XACK + XDEL of the stream's entries that passed 1 in one
--    call each, their bytes off each counter in one DECRBY, their errors in one HDEL;
-- 3. per entry: its dead letter, its done marker;
-- 4. per job: the counters of its entries that passed 3, and whether the job is complete;
-- 5. per entry, in order: the result, for entries that passed 3 and whose job counted them.
-- An error (a key of the wrong type, a job record without `groups`) fails the entries it hits,
-- as when every entry was a script call of its own; what was written before the error stays.
local consumer = ARGV[1]
local entries, sets = cmsgpack.unpack(ARGV[3]), cmsgpack.unpack(ARGV[4])

local function as_reply(ok, reply)
  if not ok and not reply.err then
    return redis.error_reply(tostring(reply))
  end
  return reply
end

-- Ownership: per stream, one XPENDING of the caller's pending entries between the batch's lowest
-- and highest id there (not one per entry). A stream whose ids do not parse, whose read fails or
-- may be cut short by its count asks per entry, as before.
local function id_parts(id)
  local dash = string.find(id, '-', 1, true)
  if not dash then
    return nil
  end
  return tonumber(string.sub(id, 1, dash - 1)), tonumber(string.sub(id, dash + 1))
end

local function before(ms1, seq1, ms2, seq2)
  return ms1 < ms2 or (ms1 == ms2 and seq1 < seq2)
end

local ranges, order = {}, {}
for _, e in ipairs(entries) do
  local k = sets[e[1]][1]
  local r = ranges[k]
  if r == nil then
    r = {n = 0}
    ranges[k] = r
    order[#order + 1] = k
  end
  if r.n >= 0 then
    local ms, seq = id_parts(e[2])
    if ms == nil or seq == nil then
      r.n = -1
    else
      if r.n == 0 or before(ms, seq, r.lo_ms, r.lo_seq) then
        r.lo_ms, r.lo_seq, r.lo = ms, seq, e[2]
      end
      if r.n == 0 or before(r.hi_ms, r.hi_seq, ms, seq) then
        r.hi_ms, r.hi_seq, r.hi = ms, seq, e[2]
      end
      r.n = r.n + 1
    end
  end
end
local owned = {}
for _, k in ipairs(order) do
  local r = ranges[k]
  if r.n > 0 then
    local limit = 4 * r.n + 64
    local ok, pending = pcall(redis.call, 'XPENDING', KEYS[k], GROUP_WORKERS, r.lo, r.hi, limit, consumer)
    if not ok and redis.call('EXISTS', KEYS[k]) == 0 then
      owned[k] = {}  -- emptied and pruned (trainer_prune.lua): nothing there is ours
    elseif ok and #pending < limit then
      local mine = {}
      for _, p in ipairs(pending) do
        mine[p[1]] = true
      end
      owned[k] = mine
    end
  end
end

local taken = {}  -- per stream: ids that passed fencing in this batch (a second result is not ours)
local function ours(k, stream, id)
  local seen = taken[k]
  if seen == nil then
    seen = {}
    taken[k] = seen
  end
  if seen[id] then
    return false
  end
  local mine = owned[k]
  local yes
  if mine == nil then
    local pending = redis.call('XPENDING', stream, GROUP_WORKERS, id, id, 1)
    yes = #pending > 0 and pending[1][2] == consumer
  else
    yes = mine[id] == true
  end
  seen[id] = yes
  return yes
end

-- Pass 1. settled[i]: REPLY_LOST or an error (the entry is done with), else nil.
local settled, waiting = {}, {}
local passed = {}  -- per stream key index: the entries (indices) that are ours, in order
for i, e in ipairs(entries) do
  local k = sets[e[1]][1]
  local ok, yes = pcall(ours, k, KEYS[k], e[2])
  if not ok then
    settled[i] = as_reply(ok, yes)
  elseif not yes then
    settled[i] = REPLY_LOST
  else
    local list = passed[k]
    if list == nil then
      list = {}
      passed[k] = list
    end
    list[#list + 1] = i
  end
end

-- Pass 2. `fn(first, last)` over the list in chunks (Lua's unpack has a stack limit); an error
-- fails the entries of the chunk it hit, as it would each of them alone.
local function chunked(list, fn)
  for first = 1, #list, 500 do
    local last = math.min(first + 499, #list)
    local ok, err = pcall(fn, first, last)
    if not ok then
      for j = first, last do
        settled[list[j]] = as_reply(ok, err)
      end
    end
  end
end

local function field(list, n)
  local out = {}
  for j, i in ipairs(list) do
    out[j] = entries[i][n]
  end
  return out
end

-- Consumed entries are deleted rather than trimmed: nothing pending is ever cut away.
local acked = {}
for _, k in ipairs(order) do
  local list = passed[k] or {}
  local ids = field(list, 2)
  chunked(list, function(first, last)
    redis.call('XACK', KEYS[k], GROUP_WORKERS, unpack(ids, first, last))
    redis.call('XDEL', KEYS[k], unpack(ids, first, last))
  end)
  for _, i in ipairs(list) do
    if not settled[i] then
      acked[#acked + 1] = i
    end
  end
end
table.sort(acked)  -- back in batch order: what follows runs per entry as before

local by_counter, counter_order = {}, {}
for _, i in ipairs(acked) do
  local k = sets[entries[i][1]][5]
  if by_counter[k] == nil then
    by_counter[k] = {n = 0, list = {}}
    counter_order[#counter_order + 1] = k
  end
  local c = by_counter[k]
  c.n = c.n + entries[i][6]
  c.list[#c.list + 1] = i
end
local function decrement(k, n)
  -- (clamped once: as clamping after each entry's share, since every share is >= 0)
  if redis.call('DECRBY', KEYS[k], n) < 0 then
    redis.call('SET', KEYS[k], 0)
  end
end
for _, k in ipairs(counter_order) do
  local c = by_counter[k]
  local ok, err = pcall(decrement, k, c.n)
  if not ok then
    for _, i in ipairs(c.list) do
      settled[i] = as_reply(ok, err)
    end
  end
end

local clean = {}
for _, i in ipairs(acked) do
  if not settled[i] then
    clean[#clean + 1] = i
  end
end
local clean_ids = field(clean, 2)
chunked(clean, function(first, last)
  redis.call('HDEL', KEYS[1], unpack(clean_ids, first, last))
end)

-- A job of more than many_groups groups gets its done hash as a hash table from its first marker:
-- a listpack (how Redis keeps a small hash: up to hash-max-listpack-entries fields, 512 here)
-- looks a field up by walking it, twice per HSETNX: a job's 385th to 512th markers cost ~93k
-- instructions each against ~8k in a hash table (callgrind; docs/benchmarks.md, "Issue 43,
-- dispatch"). A value longer than hash-max-listpack-value (64 by default) converts it. Only a
-- matter of speed: an error here changes nothing for the entry (the marker's HSETNX decides).
local many_groups = 128
local function as_table(job, done)
  if redis.call('EXISTS', done) == 0
      and (tonumber(redis.call('HGET', job, JOB_GROUPS)) or 0) > many_groups then
    redis.call('HSET', done, DONE_ENCODING, DONE_TABLE)
  end
end

-- Pass 3. Returns REPLY_DUP or false (write the result), and the entry's job when the result
-- waits for the job to count it.
local jobs, job_order = {}, {}
local function settle(e)
  local ks = sets[e[1]]
  local stream, job, done = KEYS[ks[1]], KEYS[ks[3]], KEYS[ks[4]]
  local id, group, status, reason = e[2], e[3], e[4], e[7]
  if reason then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', 100000, '*', DEAD_STREAM, stream, DEAD_ID, id,
      DEAD_REASON, reason, DEAD_ITEM, e[8])
  end
  if group == '' then
    return false, nil
  end
  local record = jobs[job]
  if record == nil then
    -- Nothing in this script creates a job record: whether it exists holds for the batch.
    record = redis.call('EXISTS', job) == 1 and {key = job, done = done, counts = {}, statuses = {}}
    jobs[job] = record
    if record then
      job_order[#job_order + 1] = record
      pcall(as_table, job, done)
    end
  end
  if not record then
    return false, nil
  end
  if redis.call('HSETNX', done, group, status) == 0 then
    return REPLY_DUP, nil
  end
  if record.counts[status] == nil then
    record.counts[status] = 0
    record.statuses[#record.statuses + 1] = status
  end
  record.counts[status] = record.counts[status] + 1
  return false, record
end

for _, i in ipairs(clean) do
  if not settled[i] then
    local ok, reply, record = pcall(settle, entries[i])
    settled[i], waiting[i] = as_reply(ok, reply), record
  end
end

-- Pass 4: per status, its count and the job's done count (as each entry added its own); then,
-- once, whether the job is complete.
local function count(record, status, n)
  redis.call('HINCRBY', record.key, status, n)
  record.finished = redis.call('HINCRBY', record.key, JOB_DONE, n)
end

local function complete(record)
  local job, done = record.key, record.done
  if record.finished >= tonumber(redis.call('HGET', job, JOB_GROUPS)) then
    local state = redis.call('HGET', job, JOB_STATE)
    -- A job cancelled by over-sampling's cut (score_pick.lua) delivered all it was asked.
    if state == STATE_PENDING or (state == STATE_CANCELLED and redis.call('HEXISTS', job, JOB_CUT) == 1) then
      redis.call('HSET', job, JOB_STATE, STATE_DONE)
    end
    redis.call('HSET', job, JOB_FINISHED_AT, redis.call('TIME')[1])
    redis.call('EXPIRE', job, ARGV[2])
    redis.call('EXPIRE', done, ARGV[2])
  end
end

for _, record in ipairs(job_order) do
  record.failed = {}
  local counted = false
  for _, status in ipairs(record.statuses) do
    local ok, err = pcall(count, record, status, record.counts[status])
    if ok then
      counted = true
    else
      record.failed[status] = as_reply(ok, err)
    end
  end
  if counted then
    local ok, err = pcall(complete, record)
    if not ok then
      record.error = as_reply(ok, err)
    end
  end
end

-- Pass 5.
local replies, written = {}, {}
for i, e in ipairs(entries) do
  local reply, record = settled[i], waiting[i]
  if record then
    reply = record.failed[e[4]] or record.error or false
  end
  if reply == false then
    local results = sets[e[1]][2]
    local ok, err = pcall(redis.call, 'XADD', KEYS[results], '*', RESULT_RESULT, e[5])
    reply = ok and REPLY_OK or as_reply(ok, err)
    if ok then
      written[results] = (written[results] or 0) + 1
    end
  end
  replies[i] = reply
end
local now = redis.call('TIME')[1]
for k, n in pairs(written) do
  redis.call('ZADD', KEYS[3], now, KEYS[k])
  redis.call('HINCRBY', KEYS[4], KEYS[k], n)
end
return replies

-- Take, renew or give up the owner lease of one derived episodes trainer: one live `Episodes`
-- object reads its result stream (two would take each other's results).
-- KEYS: the owner key.  ARGV: token, lease in ms (0: give it up).
-- Returns 1 when the caller holds it (or gave it up), 0 when another live token holds it.
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  return 0
end
if tonumber(ARGV[2]) == 0 then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
return 1

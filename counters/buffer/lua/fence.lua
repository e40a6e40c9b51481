#!lua flags=allow-oom
-- Fence the last push of a retired writer: tell whether it applied, else make it never apply.
-- KEYS[1] writer: the writer's hash: 'seq' highest push applied here, 'fenced' lowest fenced
-- KEYS[2] legacy: (optional) marker key of a push id from before writer ids: applied if '1',
--         else set to 'fenced'
-- ARGV[1] ttl: ms the writer's hash (and a new legacy marker) lives from now
-- ARGV[2] seq: sequence number of the push to fence
-- Returns 1 if the push had applied, 0 if it is fenced now.
local writer, legacy = KEYS[1], KEYS[2]
local ttl, seq = ARGV[1], tonumber(ARGV[2])
local state = redis.call('HMGET', writer, 'seq', 'fenced')
if seq <= tonumber(state[1] or '0') then return 1 end
if legacy then
  local value = redis.call('GET', legacy)
  if value == '1' then return 1 end
  if not value then redis.call('SET', legacy, 'fenced', 'PX', ttl) end
end
if not state[2] or seq < tonumber(state[2]) then redis.call('HSET', writer, 'fenced', seq) end
redis.call('PEXPIRE', writer, ttl)
return 0

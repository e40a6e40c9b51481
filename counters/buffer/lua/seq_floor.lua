#!lua flags=allow-oom
-- Raise a shard's batch sequence to at least a floor.
-- KEYS[1] seq: the shard's batch sequence
-- ARGV[1] floor: the lowest value it may have
-- Returns 1 if it was lower, else 0.
local seq = KEYS[1]
local floor = tonumber(ARGV[1])
if tonumber(redis.call('GET', seq) or '0') < floor then
  redis.call('SET', seq, floor)
  return 1
end
return 0

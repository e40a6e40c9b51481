#!lua flags=allow-oom
-- Quarantine deltas that never entered Redis; writing the same fields again adds nothing.
-- KEYS[1] quarantine: hash field -> JSON of a held delta
-- KEYS[2] qsum: member -> sum of its quarantined deltas; a delta adds to it once, with its field
-- ARGV[1..] field, value, member, delta quadruples
-- Returns how many fields were new.
local quarantine, qsum = KEYS[1], KEYS[2]
local added = 0
for i = 1, #ARGV, 4 do
  local field, value, member, delta = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if redis.call('HSET', quarantine, field, value) == 1 then
    added = added + 1
    if tonumber(delta) ~= 0 and tonumber(redis.call('ZINCRBY', qsum, delta, member)) == 0 then
      redis.call('ZREM', qsum, member)
    end
  end
end
return added

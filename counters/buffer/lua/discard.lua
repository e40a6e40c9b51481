#!lua flags=allow-oom
-- Drop quarantined deltas for good.
-- KEYS[1] quarantine: hash field -> JSON of a held delta
-- KEYS[2] qsum: member -> sum of its quarantined deltas
-- ARGV[1..] field, member, uncount triples: a field still quarantined is dropped and uncount
--           (minus the part of its delta in the member's sum) added to qsum
-- Returns how many fields were dropped.
local quarantine, qsum = KEYS[1], KEYS[2]
local dropped = 0
for i = 1, #ARGV, 3 do
  local field, member, uncount = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('HDEL', quarantine, field) == 1 then
    dropped = dropped + 1
    if tonumber(uncount) ~= 0 and tonumber(redis.call('ZINCRBY', qsum, uncount, member)) == 0
    then
      redis.call('ZREM', qsum, member)
    end
  end
end
return dropped

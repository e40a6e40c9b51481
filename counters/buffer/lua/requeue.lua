-- Put quarantined deltas back into pending, each at most once.
-- KEYS[1] pending: the shard's pending set
-- KEYS[2] quarantine: hash field -> JSON of a held delta
-- KEYS[3] since: ms time the pending set last became non-empty (set if absent)
-- KEYS[4] qsum: member -> sum of its quarantined deltas
-- ARGV[1] now_ms: ms time of the requeue
-- ARGV[2..] field, member, delta, uncount quadruples: a field still quarantined is dropped, delta
--           added to pending and uncount to qsum, unless the pending sum would leave the exact
--           range of a score
-- Returns {requeued count, refused fields...}.
local pending, quarantine, since, qsum = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now_ms = ARGV[1]
local limit = 9007199254740992
local out = {0}
for i = 2, #ARGV, 4 do
  local field, member, delta, uncount = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  if redis.call('HEXISTS', quarantine, field) == 1 then
    local sum = tonumber(redis.call('ZSCORE', pending, member) or '0') + tonumber(delta)
    if sum >= limit or sum <= -limit then
      out[#out + 1] = field
    else
      redis.call('HDEL', quarantine, field)
      if tonumber(redis.call('ZINCRBY', pending, delta, member)) == 0 then
        redis.call('ZREM', pending, member)
      end
      if tonumber(uncount) ~= 0 and tonumber(redis.call('ZINCRBY', qsum, uncount, member)) == 0
      then
        redis.call('ZREM', qsum, member)
      end
      out[1] = out[1] + 1
    end
  end
end
if out[1] > 0 then redis.call('SET', since, now_ms, 'NX') end
return out

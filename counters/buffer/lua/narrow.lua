#!lua flags=allow-oom
-- Narrow the batch in flight: send some members back to pending, keep the rest under a new id.
-- KEYS[1] pending: the shard's pending set
-- KEYS[2] inflight: the batch being applied
-- KEYS[3] batch: hash of the batch in flight: 'id', 'ts', 'seq'
-- KEYS[4] gen: bumped by the narrowing (read consistency)
-- KEYS[5] since: ms time the pending set last became non-empty (set if absent)
-- KEYS[6] seq: (optional) the narrowed batch takes the shard's next sequence number, so that
--         the DB, applying it, records a number no Redis state from before the narrowing has
-- ARGV[1] batch_id: the batch to narrow
-- ARGV[2] new_id: id of the narrowed batch
-- ARGV[3] now_ms: ms time of the narrowing
-- ARGV[4..] members sent back, unless their pending sum would leave the exact range of a score
-- Returns {1, items left in flight, the new sequence number or 0}, or {0} if batch_id is not
-- the batch in flight.
local pending, inflight, batch, gen, since = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local seq = KEYS[6]
local batch_id, new_id, now_ms = ARGV[1], ARGV[2], ARGV[3]
local limit = 9007199254740992
if redis.call('HGET', batch, 'id') ~= batch_id then return {0} end
local returned = 0
for i = 4, #ARGV do
  local member = ARGV[i]
  local delta = redis.call('ZSCORE', inflight, member)
  if delta then
    local sum = tonumber(redis.call('ZSCORE', pending, member) or '0') + tonumber(delta)
    if sum < limit and sum > -limit then
      redis.call('ZREM', inflight, member)
      if tonumber(redis.call('ZINCRBY', pending, delta, member)) == 0 then
        redis.call('ZREM', pending, member)
      end
      returned = returned + 1
    end
  end
end
if returned > 0 then redis.call('SET', since, now_ms, 'NX') end
local number = 0
if seq then
  number = redis.call('INCR', seq)
  redis.call('HSET', batch, 'seq', number)
end
redis.call('HSET', batch, 'id', new_id)
redis.call('INCR', gen)
return {1, redis.call('ZRANGE', inflight, 0, -1, 'WITHSCORES'), number}

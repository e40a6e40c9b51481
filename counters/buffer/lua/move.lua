#!lua flags=allow-oom
-- Forget an acknowledged batch, then return the batch in flight or move pending deltas into one.
-- KEYS[1] pending: the shard's pending set, member -> summed delta
-- KEYS[2] inflight: the batch being applied, same shape
-- KEYS[3] batch: hash of the batch in flight: 'id', 'ts' (ms moved), 'seq'
-- KEYS[4] gen: bumped by every move and ack (read consistency)
-- KEYS[5] since: ms time the pending set last became non-empty (deleted once it is empty)
-- KEYS[6] seq: sequence of the last batch moved; the new batch takes the next (see epoch.py)
-- ARGV[1] batch_id: id of the new batch
-- ARGV[2] limit: most members moved, lowest scores first
-- ARGV[3] now_ms: ms time of the move
-- ARGV[4] acked: id of a batch to forget first if it is still in flight ('' for none)
-- ARGV[5..] only these members, when given
-- Returns {'inflight', id, ts, items, seq} (a batch already in flight), {'moved', id, ts, items,
-- seq} or {'empty'}; items are member, integer score pairs. Needs Redis 6.2 (ZRANGESTORE).
local pending, inflight, batch, gen = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local since, seq = KEYS[5], KEYS[6]
local batch_id, limit, now_ms, acked = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local current = redis.call('HGET', batch, 'id')
if current and current == acked then
  redis.call('DEL', inflight, batch)
  redis.call('INCR', gen)
  current = false
end
if current then
  local info = redis.call('HMGET', batch, 'ts', 'seq')
  local flat = redis.call('ZRANGE', inflight, 0, -1, 'WITHSCORES')
  for i = 2, #flat, 2 do flat[i] = tonumber(flat[i]) end
  return {'inflight', current, info[1], flat, info[2] or '0'}
end
local items = {}
if #ARGV > 4 then
  local chunk, found = {}, 0
  for i = 5, math.min(#ARGV, limit + 4) do
    local score = redis.call('ZSCORE', pending, ARGV[i])
    if score then
      redis.call('ZREM', pending, ARGV[i])
      found = found + 1
      if tonumber(score) ~= 0 then
        items[#items + 1] = ARGV[i]
        items[#items + 1] = tonumber(score)
        chunk[#chunk + 1] = score
        chunk[#chunk + 1] = ARGV[i]
        if #chunk >= 1000 then redis.call('ZADD', inflight, unpack(chunk)); chunk = {} end
      end
    end
  end
  if #chunk > 0 then redis.call('ZADD', inflight, unpack(chunk)) end
  if redis.call('EXISTS', pending) == 0 then redis.call('DEL', since) end
  if found == 0 then return {'empty'} end
else
  -- the lowest scores first, as ZPOPMIN; copied and removed in C, not member by member
  local moved = redis.call('ZRANGESTORE', inflight, pending, 0, limit - 1)
  if moved == 0 then return {'empty'} end
  redis.call('ZREMRANGEBYRANK', pending, 0, limit - 1)
  redis.call('ZREMRANGEBYSCORE', inflight, 0, 0)  -- zero sums are dropped, never applied
  if redis.call('EXISTS', pending) == 0 then redis.call('DEL', since) end
  items = redis.call('ZRANGE', inflight, 0, -1, 'WITHSCORES')
  for i = 2, #items, 2 do items[i] = tonumber(items[i]) end
end
local number = 0
if #items > 0 then
  number = redis.call('INCR', seq)
  redis.call('HSET', batch, 'id', batch_id, 'ts', now_ms, 'seq', number)
  redis.call('INCR', gen)
end
return {'moved', batch_id, now_ms, items, number}

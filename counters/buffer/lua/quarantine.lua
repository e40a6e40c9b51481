#!lua flags=allow-oom
-- Quarantine the batch in flight: hold each of its deltas in the quarantine, forget the batch.
-- KEYS[1] inflight: the batch being applied
-- KEYS[2] batch: hash of the batch in flight ('id')
-- KEYS[3] gen: bumped when the batch is forgotten (read consistency)
-- KEYS[4] quarantine: hash field -> JSON of a held delta
-- KEYS[5] qsum: member -> sum of its quarantined deltas; a delta adds to it once, with its field
-- ARGV[1] batch_id: the batch to quarantine
-- ARGV[2..] field, value, member, delta quadruples
-- Returns 1 if it was the batch in flight, else 0 (nothing changed).
local inflight, batch, gen, quarantine, qsum = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local batch_id = ARGV[1]
if redis.call('HGET', batch, 'id') ~= batch_id then return 0 end
for i = 2, #ARGV, 4 do
  if redis.call('HSET', quarantine, ARGV[i], ARGV[i + 1]) == 1 then
    if tonumber(redis.call('ZINCRBY', qsum, ARGV[i + 3], ARGV[i + 2])) == 0 then
      redis.call('ZREM', qsum, ARGV[i + 2])
    end
  end
end
redis.call('DEL', inflight, batch)
redis.call('INCR', gen)
return 1

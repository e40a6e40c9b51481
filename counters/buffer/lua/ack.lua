#!lua flags=allow-oom
-- Forget the batch in flight only if it is still the one named.
-- KEYS[1] inflight: the batch being applied
-- KEYS[2] batch: hash of the batch in flight: 'id', 'ts', 'seq'
-- KEYS[3] gen: bumped when the batch is forgotten (read consistency)
-- ARGV[1] batch_id: the batch to forget
-- Returns 1 if it was forgotten, 0 if another batch (or none) is in flight.
local inflight, batch, gen = KEYS[1], KEYS[2], KEYS[3]
local batch_id = ARGV[1]
if redis.call('HGET', batch, 'id') == batch_id then
  redis.call('DEL', inflight, batch)
  redis.call('INCR', gen)
  return 1
end
return 0

-- Snapshot of one shard for reads: members' buffered sums and writers' high-water marks.
-- KEYS[1] pending: the shard's pending set
-- KEYS[2] inflight: the batch being applied
-- KEYS[3] batch: hash of the batch in flight ('id')
-- KEYS[4] gen: generation, bumped by every move and ack
-- KEYS[5] since: not read (passed with the shard's keys)
-- KEYS[6] qsum: member -> sum of its quarantined deltas
-- KEYS[7..] writer hashes whose 'seq' (highest push applied) is read
-- ARGV[1..] members
-- Returns {gen, batch id in flight or '', then pending, in-flight and quarantined sum per member,
-- then each writer's high-water mark}; '0' where absent.
local pending, inflight, batch, gen, qsum = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6]
local members, first_writer = ARGV, 7
local out = {redis.call('GET', gen) or '0', redis.call('HGET', batch, 'id') or ''}
for _, member in ipairs(members) do
  out[#out + 1] = redis.call('ZSCORE', pending, member) or '0'
  out[#out + 1] = redis.call('ZSCORE', inflight, member) or '0'
  out[#out + 1] = redis.call('ZSCORE', qsum, member) or '0'
end
for i = first_writer, #KEYS do
  out[#out + 1] = redis.call('HGET', KEYS[i], 'seq') or '0'
end
return out

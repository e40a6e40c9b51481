-- Add deltas to one shard's pending set as one push of a writer: at most once, in order.
-- KEYS[1] pending: the shard's pending set, member -> summed delta
-- KEYS[2] writer: the writer's hash: 'seq' highest push applied here, 'fenced' lowest fenced
-- KEYS[3] since: ms time the pending set last became non-empty (set if absent, deleted
--   when the push leaves the set empty)
-- KEYS[4] suspects: member -> pushes that changed it since it was marked, for the members an
--   audit or rebuild is confirming (verify/drift.py); when the hash exists, each marked
--   member this push changes is counted once
-- KEYS[5] live (only in a push with live members): the start of the shard's channels; a
--   live member's change goes to KEYS[5] .. member (the shard's hash tag: the script's slot)
-- ARGV[1] ttl: ms the writer's hash lives after its last push or fence
-- ARGV[2] sent_at: ms time the writer sent the push
-- ARGV[3] max_age: ms after sent_at past which the push is refused as delivered late
-- ARGV[4] seq: sequence number of the push; a repeat, an older or a fenced one is refused
-- ARGV[5..] member, delta pairs; with KEYS[5], each live member is announced on its channel
--   once added, an empty message (a shard channel; a plain one on Redis before 7)
-- ARGV[5] live (with KEYS[5] and an odd number of arguments): only this many members are
--   live, whose pairs come first, from ARGV[6]
-- Returns 1 added, 0 refused (repeat, older, fenced), 2 delivered late, or {3, members...}:
-- those members' sums would leave the exact range of a score, and nothing was added.
local pending, writer, since, suspects = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ttl, sent_at, max_age, seq = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local limit = 9007199254740992
local first, live = 5, 0
if #KEYS > 4 then  -- an odd number of arguments: the number of live members first
  if #ARGV % 2 == 1 then first, live = 6, tonumber(ARGV[5]) else live = (#ARGV - 4) / 2 end
end
local now = redis.call('TIME')
if (tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)) - tonumber(sent_at)
    > tonumber(max_age) then
  return 2
end
local state = redis.call('HMGET', writer, 'seq', 'fenced')
if seq <= tonumber(state[1] or '0') then return 0 end
if state[2] and seq >= tonumber(state[2]) then return 0 end
local refused = {3}
for i = first, #ARGV, 2 do
  local sum = tonumber(redis.call('ZSCORE', pending, ARGV[i]) or '0') + tonumber(ARGV[i + 1])
  if sum >= limit or sum <= -limit then refused[#refused + 1] = ARGV[i] end
end
if #refused > 1 then return refused end
redis.call('HSET', writer, 'seq', seq)
redis.call('PEXPIRE', writer, ttl)
redis.call('SET', since, sent_at, 'NX')
local emptied = false
for i = first, #ARGV, 2 do
  if tonumber(redis.call('ZINCRBY', pending, ARGV[i + 1], ARGV[i])) == 0 then
    redis.call('ZREM', pending, ARGV[i])
    emptied = true
  end
end
-- deltas that cancelled out may leave the set empty: its mark goes with it
if emptied and redis.call('EXISTS', pending) == 0 then redis.call('DEL', since) end
-- members being confirmed: one EXISTS per push while nothing is
if suspects and redis.call('EXISTS', suspects) == 1 then
  for i = first, #ARGV, 2 do
    if redis.call('HEXISTS', suspects, ARGV[i]) == 1 then
      redis.call('HINCRBY', suspects, ARGV[i], 1)
    end
  end
end
-- each live member on its own channel (one nobody subscribed to costs a dictionary lookup)
local publish = 'SPUBLISH'
for i = first, first + 2 * live - 2, 2 do
  local sent = redis.pcall(publish, KEYS[5] .. ARGV[i], '')
  if type(sent) == 'table' and sent.err then
    publish = 'PUBLISH'
    redis.call(publish, KEYS[5] .. ARGV[i], '')
  end
end
return 1

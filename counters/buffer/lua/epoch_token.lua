#!lua flags=allow-oom
-- Give a shard its epoch token unless it has one.
-- KEYS[1] epoch: the shard's epoch token
-- ARGV[1] token: a new random token
-- Returns the token the shard holds.
local epoch = KEYS[1]
local token = ARGV[1]
redis.call('SET', epoch, token, 'NX')
return redis.call('GET', epoch)

#!lua flags=allow-oom
-- Take a lease unless it is held.
-- KEYS[1] lease: the lease key, holding its holder's token
-- ARGV[1] token: the random token of the new holder
-- ARGV[2] ttl: ms the lease lasts
-- Returns 1 if taken, else 0.
local lease = KEYS[1]
local token, ttl = ARGV[1], ARGV[2]
if redis.call('SET', lease, token, 'NX', 'PX', ttl) then return 1 end
return 0

#!lua flags=allow-oom
-- Push back the expiry of a lease if it still holds our token.
-- KEYS[1] lease: the lease key, holding its holder's token
-- ARGV[1] token: our token
-- ARGV[2] ttl: ms the lease lasts from now
-- Returns 1 if extended, else 0.
local lease = KEYS[1]
local token, ttl = ARGV[1], ARGV[2]
if redis.call('GET', lease) == token then
  return redis.call('PEXPIRE', lease, ttl)
end
return 0

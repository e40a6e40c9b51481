#!lua flags=allow-oom
-- Delete a lease if it still holds our token.
-- KEYS[1] lease: the lease key, holding its holder's token
-- ARGV[1] token: our token
-- Returns 1 if deleted, else 0.
local lease = KEYS[1]
local token = ARGV[1]
if redis.call('GET', lease) == token then
  return redis.call('DEL', lease)
end
return 0

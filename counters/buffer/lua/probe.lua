#!lua flags=allow-oom
-- Runs only where the server reads script flags (Redis 7): tells whether it does.
-- Returns 1.
return 1

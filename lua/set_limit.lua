--[[ set_limit: set, lift or reset a rate limit on one shard, at run time.

The caller sets it on every shard (a limit is enforced per shard, at its
share of the rate: includes/shaping_release.lua).

KEYS[1]  run-time limits   {p}:{s}:limits
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  the limit's key (a task name, 'queue:<name>', 'tenant:<name>', 'tenant:*')
ARGV[3]  jobs per second; '0' lifts the app's limit of that key; '' forgets what
         was set at run time (the app's `delayed_rate_limits` applies again)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number

Wakes the shard's scheduler: jobs waiting for a token may go sooner now.
Returns 1.
]]
-- @include "common"

local now = now_ms(ARGV[1])
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[2])
else
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
end
redis.call('PUBLISH', ARGV[4], ARGV[5] .. ':' .. now)
return 1

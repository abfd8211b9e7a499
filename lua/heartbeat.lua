--[[ heartbeat: keep a scheduler's membership alive, drop expired members.

KEYS[1]  scheduler set     {p}:schedulers (owner token -> membership deadline, ms)
KEYS[2]  their settings    {p}:{{p}:schedulers}:settings (owner token -> the settings
         every scheduler of the store must share, "name=value;...")
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  owner token
ARGV[3]  membership lease, ms (a member silent this long is dead)
ARGV[4]  '1' to leave the set (clean shutdown), '' otherwise
ARGV[5]  the caller's settings string

Returns {now, live member tokens sorted ...}.

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"

local now = now_ms(ARGV[1])
if ARGV[4] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('HDEL', KEYS[2], ARGV[2])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[5])
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(dead))
end
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
table.sort(live)
local out = {now}
for _, m in ipairs(live) do out[#out + 1] = m end
return out

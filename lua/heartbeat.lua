--[[ heartbeat: keep a scheduler's membership alive, drop expired members.

KEYS[1]  scheduler set     {p}:schedulers (owner token -> membership deadline, ms)
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  owner token
ARGV[3]  membership lease, ms (a member silent this long is dead)
ARGV[4]  '1' to leave the set (clean shutdown), '' otherwise

Returns {now, live member tokens sorted ...}.
]]
-- @include "common"

local now = now_ms(ARGV[1])
if ARGV[4] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[2])
else
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local live = redis.call('ZRANGE', KEYS[1], 0, -1)
table.sort(live)
local out = {now}
for _, m in ipairs(live) do out[#out + 1] = m end
return out

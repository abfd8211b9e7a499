--[[ heartbeat: keep a scheduler's membership alive, drop expired members.

The membership is what keeps a scheduler's shards its own: a shard's lease
(shard_lease.lua) has no deadline, and another member takes it only once its
holder is no longer a live member. So an idle scheduler renews nothing but
this, and the script stays small: four commands (TIME, ZADD, ZRANGE and this
call) when nobody joins or dies.

KEYS[1]  scheduler set     {p}:schedulers (owner token -> membership deadline, ms)
KEYS[2]  their settings    {p}:{{p}:schedulers}:settings (owner token -> the settings
         every scheduler of the store must share, "name=value;..."), written when
         a member (re)joins
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  owner token
ARGV[3]  membership lease, ms (a member silent this long is dead)
ARGV[4]  '1' to leave the set (clean shutdown), '' otherwise
ARGV[5]  the caller's settings string

Returns {now, joined, member, deadline, member, deadline ...}: the live members
sorted by token, each with its membership deadline (ms); joined = 1 when this
call added the caller to the set (its first heartbeat, or it had been dropped
as dead, or the set was lost: whatever shards it held may have been taken
since), else 0.

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"

local now = now_ms(ARGV[1])
local joined = 0
if ARGV[4] == '1' then
  redis.call('ZREM', KEYS[1], ARGV[2])
  redis.call('HDEL', KEYS[2], ARGV[2])
else
  joined = redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  if joined == 1 then redis.call('HSET', KEYS[2], ARGV[2], ARGV[5]) end
end
local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local live, dead, deadline = {}, {}, {}
for i = 1, #all, 2 do
  local d = tonumber(all[i + 1])
  if d <= now then
    dead[#dead + 1] = all[i]
  else
    live[#live + 1] = all[i]
    deadline[all[i]] = all[i + 1]
  end
end
if #dead > 0 then
  redis.call('ZREM', KEYS[1], unpack(dead))
  redis.call('HDEL', KEYS[2], unpack(dead))
end
table.sort(live)
local out = {now, joined}
for _, m in ipairs(live) do
  out[#out + 1] = m
  out[#out + 1] = deadline[m]
end
return out

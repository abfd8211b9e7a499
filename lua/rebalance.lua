--[[ rebalance: hand the shards out over the live schedulers; return the caller's.

Shard i goes to the (i mod M)-th live member in sorted order, so M schedulers
hold N/M shards each. A shard whose lease names another owner is handed over:
its fence is incremented and the lease rewritten "<owner>|<fence>". Release
scripts compare the lease with the caller's owner and fence, so a scheduler
that lost a shard (paused, partitioned) can no longer release from it.
Deterministic: every live member computes the same assignment.

KEYS[1]          scheduler set {p}:schedulers
KEYS[2..N+1]     lease key of shard 0 .. N-1   {p}:{i}:lease
KEYS[N+2..2N+1]  fence key of shard 0 .. N-1   {p}:{i}:fence
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  the caller's owner token

Returns {shard, fence, shard, fence, ...} of the shards the caller now holds
(empty when the caller is not a live member).

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"

local now = now_ms(ARGV[1])
-- Exclusive, as heartbeat.lua: a member whose deadline is now is dead.
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
table.sort(live)
local m = #live
local n = (#KEYS - 1) / 2
local out = {}
if m == 0 then return out end
for i = 0, n - 1 do
  local want = live[(i % m) + 1]
  local lease_key, fence_key = KEYS[2 + i], KEYS[2 + n + i]
  local cur = redis.call('GET', lease_key)
  local fence
  if cur and string.sub(cur, 1, #want + 1) == want .. '|' then
    fence = string.sub(cur, #want + 2)
  else
    fence = tostring(redis.call('INCR', fence_key))
    redis.call('SET', lease_key, want .. '|' .. fence)
  end
  if want == ARGV[2] then
    out[#out + 1] = i
    out[#out + 1] = fence
  end
end
return out

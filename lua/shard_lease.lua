--[[ shard_lease: take, keep or give up one shard's lease (one slot: the shard's).

Every scheduler computes from the live members which shards it should hold
(shard i goes to the (i mod M)-th live member in sorted order) and calls this
script for each shard it wants or holds: there is no script over every shard,
so the store runs on Redis Cluster. A shard held by another member is taken
only once its lease ran out or its holder gave it up; a new holder raises the
shard's fence, and the release scripts compare the lease with the caller's
owner and fence, so a scheduler that lost a shard (paused past its lease,
partitioned) can no longer release from it.

KEYS[1]  lease key        {p}:{s}:lease        "<owner>|<fence>" (read by release_due / claim_due)
KEYS[2]  fence counter    {p}:{s}:fence        INCR on every new holder
KEYS[3]  lease deadline   {p}:{s}:lease_until  epoch ms (by the clock of ARGV[1])
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  owner token
ARGV[3]  lease, ms ('0' = give it up)

A lease without a deadline (written by rebalance.lua in earlier versions) counts as run out.

Returns {code, fence, wait}:
  OK         the caller holds the shard now (taken, or kept with its fence:
             the deadline moves on), or gave it up (fence '')
  NOT_OWNER  another owner's lease is alive: wait = ms until it runs out

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"

local now = now_ms(ARGV[1])
local owner, ms = ARGV[2], tonumber(ARGV[3])
local cur = redis.call('GET', KEYS[1])
local mine = cur and string.sub(cur, 1, #owner + 1) == owner .. '|'
local left = (tonumber(redis.call('GET', KEYS[3])) or 0) - now
if cur and not mine and left > 0 then return {NOT_OWNER, '', left} end
if ms == 0 then
  if mine then redis.call('DEL', KEYS[1], KEYS[3]) end
  return {OK, '', 0}
end
local fence
if mine then  -- kept (even past its deadline: nobody took it since, or the lease would name them)
  fence = string.sub(cur, #owner + 2)
else  -- a new holder
  fence = tostring(redis.call('INCR', KEYS[2]))
  redis.call('SET', KEYS[1], owner .. '|' .. fence)
end
redis.call('SET', KEYS[3], now + ms)
return {OK, fence, 0}

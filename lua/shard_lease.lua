--[[ shard_lease: take, check or give up one shard's lease (one slot: the shard's).

Every scheduler computes from the live members which shards it should hold
(shard i goes to the (i mod M)-th live member in sorted order) and calls this
script for each shard it wants and does not hold yet, or gives up: there is no
script over every shard, so the store runs on Redis Cluster. A lease has no
deadline of its own: it stays its holder's for as long as the holder is a live
member (heartbeat.lua), so a scheduler renews nothing per shard. Another
member takes a shard only when its holder gave it up or is not among the live
members the caller passes (dead: its membership ran out and a heartbeat dropped
it). A new holder raises the shard's fence, and the release scripts compare
the lease with the caller's owner and fence, so a scheduler that lost a shard
(paused past its membership, partitioned) can no longer release from it.

KEYS[1]  lease key        {p}:{s}:lease        "<owner>|<fence>" (read by release_due / claim_due)
KEYS[2]  fence counter    {p}:{s}:fence        INCR on every new holder
ARGV[1]  now, epoch ms (not read: a shard's lease has no deadline)
ARGV[2]  owner token
ARGV[3]  '1' to give the lease up, '' to take or keep it
ARGV[4..] the live members, as the caller's last heartbeat returned them

Returns {code, fence, holder}:
  OK         the caller holds the shard now (taken with a new fence, or held
             already: its fence), or gave it up or never held it (fence '')
  NOT_OWNER  another live member holds it: holder = that member's token

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"

local owner, give = ARGV[2], ARGV[3] == '1'
local cur = redis.call('GET', KEYS[1])
local holder, fence
if cur then holder, fence = string.match(cur, '^(.*)|([^|]*)$') end
if holder == owner then
  if give then
    redis.call('DEL', KEYS[1])
    return {OK, '', ''}
  end
  return {OK, fence, ''}
end
if give then return {OK, '', ''} end  -- not the caller's: nothing to give up
if holder then
  for i = 4, #ARGV do
    if ARGV[i] == holder then return {NOT_OWNER, '', holder} end
  end
end
fence = tostring(redis.call('INCR', KEYS[2]))
redis.call('SET', KEYS[1], owner .. '|' .. fence)
return {OK, fence, ''}

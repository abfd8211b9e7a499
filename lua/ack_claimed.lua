--[[ ack_claimed: confirm that claimed jobs were published (publish path).

KEYS[1]  in-flight set     {p}:{s}:inflight
KEYS[2]  released set      {p}:{s}:released
KEYS[3]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  ttl of a released job's record, ms
ARGV[4]  '1' to append to the change log (a database mirrors the store), '' not
ARGV[5..] job ids

Returns the number of jobs acknowledged. A job no longer in flight (acked
already, or cancelled) is not counted. An ack that comes after the claim
expired still counts, even when another scheduler claimed the job again: the
caller did publish it, and that other scheduler's ack then counts nothing
(at-least-once: the job may be published twice). A job cancelled while in
flight keeps its CANCELLED state. Each job that becomes QUEUED counts as
released in the shard's stats (includes/ops.lua), and so does one a worker
started before the ack came (its record gets `released` then, if it has none).

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"
-- @include "changes"
-- @include "ops"

local now = now_ms(ARGV[1])
local prefix, ttl = ARGV[2], tonumber(ARGV[3])
local n, queued, ran = 0, {}, 0
for i = 5, #ARGV do
  local id = ARGV[i]
  if redis.call('ZREM', KEYS[1], id) == 1 then
    local jk = prefix .. id
    -- Only a job still CLAIMED becomes QUEUED: one a worker already started
    -- (RUNNING, or finished with its done-marker TTL) or a retry scheduled
    -- again keeps its message and TTL as they are.
    local st = redis.call('HGET', jk, 'st')
    if st == 'CLAIMED' then
      -- The message stays until the job starts: the reconciler sends it again if the broker loses it.
      redis.call('HSET', jk, 'st', 'QUEUED', 'released', now)
      redis.call('PEXPIRE', jk, ttl)
      released_add(KEYS[2], id, redis.call('HGET', jk, 'due'))
      queued[#queued + 1] = id
    elseif st and st ~= 'CANCELLED' then
      -- A worker started it before this ack came (a fast broker and worker): it was
      -- released all the same, and counts so; its record says when.
      if redis.call('HSETNX', jk, 'released', now) == 1 then ran = ran + 1 end
    end
    n = n + 1
  end
end
log_change(KEYS[3], ARGV[4], 'QUEUED', queued)
stats_add(shard_base(KEYS[1]), 'released', #queued + ran, 'queued', #queued)
return n

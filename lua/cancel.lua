--[[ cancel: cancel one job, O(1), durable.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  in-flight set     {p}:{s}:inflight
KEYS[4]  job record        {p}:{s}:job:<id>
ARGV[1]  job id
ARGV[2]  bucket width, ms (0 = one due set)
ARGV[3]  now, epoch ms ('' = the Redis server's TIME)
ARGV[4]  ttl of the cancelled record, ms
ARGV[5]  '1' to cancel a RUNNING job too (the caller terminates its execution;
         the worker's heartbeat then finds its lease lost), '' otherwise

Returns {code, previous state}:
   1  cancelled; previous state SCHEDULED (unindexed), CLAIMED or QUEUED
      (the worker re-reads the state and skips it), or RUNNING (ARGV[5])
   0  no such job
  -1  not cancellable in its state (RUNNING, SUCCEEDED, CANCELLED, ...)
]]
-- @include "common"

local st, due = unpack(redis.call('HMGET', KEYS[4], 'st', 'due'))
if not st then return {0, ''} end
local running = st == 'RUNNING' and ARGV[5] == '1'
if st ~= 'SCHEDULED' and st ~= 'CLAIMED' and st ~= 'QUEUED' and not running then return {-1, st} end
local now = now_ms(ARGV[3])
if st == 'SCHEDULED' then
  due_rem(KEYS[1], KEYS[2], ARGV[1], tonumber(due), tonumber(ARGV[2]))
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[4], 'st', 'CANCELLED', 'cancelled', now)
redis.call('HDEL', KEYS[4], 'msg', 'lo', 'lu')
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[4]))
return {1, st}

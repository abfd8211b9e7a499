--[[ cancel: cancel one job, O(1), durable.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  in-flight set     {p}:{s}:inflight
KEYS[4]  job record        {p}:{s}:job:<id>
KEYS[5]  released set      {p}:{s}:released
KEYS[6]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job id
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  ttl of the cancelled record, ms
ARGV[5]  '1' to cancel a RUNNING job too (the caller terminates its execution;
         the worker's heartbeat then finds its lease lost), '' otherwise
ARGV[6]  '1' to append to the change log (a database mirrors the store), '' not

Returns {code, previous state}:
  OK           cancelled; previous state SCHEDULED (unindexed), CLAIMED or
               QUEUED (the worker re-reads the state and skips it), or
               RUNNING (ARGV[5])
  NOT_FOUND    no such job
  WRONG_STATE  not cancellable in its state (RUNNING, SUCCEEDED, CANCELLED, ...)

A SCHEDULED job leaves the pending index (and a pause's held set); the
shard's stats count the cancel (includes/ops.lua).

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"
-- @include "due_index"
-- @include "changes"
-- @include "ops"
-- @include "shaping"
-- @include "compact"

local jk = KEYS[4]
local st, due, task, q, tp = unpack(redis.call('HMGET', jk, 'st', 'due', 'task', 'q', 'tp'))
if not st then return {NOT_FOUND, ''} end
local running = st == 'RUNNING' and ARGV[5] == '1'
if st ~= 'SCHEDULED' and st ~= 'CLAIMED' and st ~= 'QUEUED' and not running then return {WRONG_STATE, st} end
local now = now_ms(ARGV[1])
local base = shard_base(jk)
task, q = route_of(base, task, q, tp)
if st == 'SCHEDULED' then
  due_rem(KEYS[1], KEYS[2], ARGV[2], tonumber(due), tonumber(ARGV[3]))
  ix_rem(base, task, q, ARGV[2])
  redis.call('ZREM', base .. 'held', ARGV[2])
  shaping_forget(base, jk, ARGV[2])
end
stats_add(base, 'cancelled', 1, 'queued', st == 'QUEUED' and -1 or 0, 'running', st == 'RUNNING' and -1 or 0)
redis.call('ZREM', KEYS[3], ARGV[2])
released_rem(KEYS[5], ARGV[2])
redis.call('HSET', jk, 'st', 'CANCELLED', 'cancelled', now)
drop_message(jk)
redis.call('HDEL', jk, 'lo', 'lu')
redis.call('PEXPIRE', jk, tonumber(ARGV[4]))
log_change(KEYS[6], ARGV[6], 'CANCELLED', {ARGV[2]})
return {OK, st}

--[[ dead: move a job that ran out of attempts to the shard's dead-letter queue.

The record stays (st=DEAD, no expiry) with the failure's details and a
message ready to requeue; the dlq set indexes it by its time of death. The
set is then trimmed by age and by count, so the dead-letter queue is bounded.

KEYS[1]  job record        {p}:{s}:job:<id>
KEYS[2]  dead letters      {p}:{s}:dlq
KEYS[3]  in-flight set     {p}:{s}:inflight
KEYS[4]  released set      {p}:{s}:released
KEYS[5]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job id
ARGV[3]  job key prefix    {p}:{s}:job:
ARGV[4]  max age of a dead letter, ms (older ones are dropped)
ARGV[5]  most dead letters this shard keeps
ARGV[6]  start of the attempt that failed, epoch ms ('' = now)
ARGV[7]  execution owner token (worker side lease, `lo`; '' = no check)
ARGV[8]  '1' to append to the change log (a database mirrors the store), '' not
ARGV[9]  F, the number of record fields that follow
ARGV[10 .. 9+F]     field names (task, q, ex, rk, msg, lk, bx, ps, etype, emsg,
                    tb, host, args, kwargs, attempts, ...)
ARGV[10+F .. 9+2F]  their values ('' removes the field)

Returns {code, previous state, dropped}:
  OK           DEAD (previous state QUEUED, CLAIMED, RUNNING, or '' for a new
               record); dropped = dead letters trimmed by age or count
  WRONG_STATE  SCHEDULED (a retry is pending), CANCELLED or finished: nothing changed
  NOT_OWNER    RUNNING under another execution's lease: nothing changed
]]
-- @include "common"
-- @include "attempts"
-- @include "dlq"
-- @include "changes"
-- @include "ops"

local jk, id = KEYS[1], ARGV[2]
local st = redis.call('HGET', jk, 'st')
if st and not FAILABLE[st] then return {WRONG_STATE, st, 0} end
if not owns(jk, st, ARGV[7]) then return {NOT_OWNER, st, 0} end
local now = now_ms(ARGV[1])
local started = attempt_started(jk, st, ARGV[6], now)
set_fields(jk, 10, tonumber(ARGV[9]))
close_attempt(jk, 'DEAD', 'died', started, now)
redis.call('HDEL', jk, 'released', 'reason')
redis.call('PERSIST', jk)  -- bounded by the trim below, not by a ttl
redis.call('ZREM', KEYS[3], id)
released_rem(KEYS[4], id)
redis.call('ZADD', KEYS[2], now, id)
log_change(KEYS[5], ARGV[8], 'DEAD', {id})
stats_add(shard_base(jk), 'dead', 1, 'queued', st == 'QUEUED' and -1 or 0, 'running', st == 'RUNNING' and -1 or 0)
local dropped = dlq_trim(KEYS[2], ARGV[3], now - tonumber(ARGV[4]), tonumber(ARGV[5]), 1000)
return {OK, st or '', dropped}

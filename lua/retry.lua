--[[ retry: schedule the next attempt of a job that is running (or was released).

The next attempt's message (same task id and arguments, `retries` header
raised) replaces the job's message, and the job is indexed again in the due
set: one script, so the attempt is either scheduled or not, never both queued
and scheduled. A job with no record (sent to the broker without the store) gets
one.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  in-flight set     {p}:{s}:inflight
KEYS[5]  job record        {p}:{s}:job:<id>
KEYS[6]  released set      {p}:{s}:released
KEYS[7]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job id
ARGV[3]  due: '<ms>' epoch ms, or '+<ms>' a delay added to now
ARGV[4]  bucket width, ms (0 = one due set)
ARGV[5]  wake channel      {p}:wake
ARGV[6]  shard number
ARGV[7]  retries: the new message's `retries` header (1 for the first retry)
ARGV[8]  start of the attempt that failed, epoch ms ('' = now)
ARGV[9]  execution owner token (worker side lease, `lo`; '' = no check)
ARGV[10] '1' to append to the change log (a database mirrors the store), '' not
ARGV[11] F, the number of record fields that follow
ARGV[12 .. 11+F]     field names (task, q, ex, rk, msg, lk, bx, ps, ev, etype, ...)
ARGV[12+F .. 11+2F]  their values ('' removes the field)

Returns {code, previous state, due ms}:
  OK           scheduled (previous state QUEUED, CLAIMED, RUNNING, or '' for a
               new record)
  UNCHANGED    it is SCHEDULED already (a duplicate delivery retried first)
  WRONG_STATE  it is CANCELLED or finished (state says which): nothing changed
  NOT_OWNER    it is RUNNING under another execution's lease: nothing changed
The job is indexed again by task and queue; the shard's stats count the retry
and the gauges of the state it leaves (includes/ops.lua).
]]
-- @include "common"
-- @include "due_index"
-- @include "attempts"
-- @include "changes"
-- @include "ops"
-- @include "shaping"

local jk, id = KEYS[5], ARGV[2]
local st, old_due = unpack(redis.call('HMGET', jk, 'st', 'due'))
if st == 'SCHEDULED' then return {UNCHANGED, st, tonumber(old_due)} end
if st and not FAILABLE[st] then return {WRONG_STATE, st, 0} end
if not owns(jk, st, ARGV[9]) then return {NOT_OWNER, st, 0} end
local now = now_ms(ARGV[1])
local bucket_ms = tonumber(ARGV[4])
local due = due_from(ARGV[3], now)
local started = attempt_started(jk, st, ARGV[8], now)

if not st then redis.call('HSET', jk, 'created', now) end
set_fields(jk, 12, tonumber(ARGV[11]))
drop_lease(jk)
redis.call('HSET', jk, 'st', 'SCHEDULED', 'due', due, 'retries', ARGV[7], 'last_at', started)
redis.call('HSETNX', jk, 'first_at', started)
redis.call('HDEL', jk, 'released')
redis.call('PERSIST', jk)  -- a released record was set to expire
redis.call('ZREM', KEYS[4], id)  -- a CLAIMED job: its late ack must not touch it
released_rem(KEYS[6], id)
due_add_job(KEYS[1], KEYS[2], jk, id, due, bucket_ms)
local base = shard_base(jk)
local task, q = unpack(redis.call('HMGET', jk, 'task', 'q'))
ix_add(base, task, q, id, due)
stats_add(base, 'retried', 1, 'queued', st == 'QUEUED' and -1 or 0, 'running', st == 'RUNNING' and -1 or 0)
maybe_wake(KEYS[3], ARGV[5], ARGV[6], due)
log_change(KEYS[7], ARGV[10], 'SCHEDULED', {id})
return {OK, st or '', due}

--[[ finish: end an execution: record its outcome and give the lease back.

KEYS[1]  job record        {p}:{s}:job:<id>
KEYS[2]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  execution owner token (as given to start)
ARGV[3]  outcome: SUCCEEDED or FAILED (terminal: the record becomes the done
         marker and expires after its ttl), or QUEUED (the task re-queued
         itself, e.g. Celery's own retry: the next delivery may start it)
ARGV[4]  ttl of a finished record, ms (delayed_done_ttl_s)
ARGV[5]  ttl of a finished record that has an idempotency key, ms
         (delayed_idempotency_ttl_s; the longer of the two applies)
ARGV[6]  reason ('' = none), kept as 'reason'
ARGV[7]  the job id
ARGV[8]  '1' to append to the change log (a database mirrors the store), '' not

Returns {code, state}:
  OK          recorded; state = the outcome
  NOT_FOUND   no record (it expired): nothing written
  NOT_OWNER   not this owner's any more (cancelled while running, or taken
              over after the lease passed); state = the current state, nothing
              changed

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining. The shard's stats count the outcome
and the running / queued gauges (includes/ops.lua).
]]
-- @flags allow-oom
-- @include "common"
-- @include "changes"
-- @include "ops"
-- @include "compact"

local jk = KEYS[1]
local st, lo, ik = unpack(redis.call('HMGET', jk, 'st', 'lo', 'ik'))
if not st then return {NOT_FOUND, ''} end
if st ~= 'RUNNING' or lo ~= ARGV[2] then return {NOT_OWNER, st} end
local outcome = ARGV[3]
local base = shard_base(jk)
stats_add(base, 'running', -1, 'queued', outcome == 'QUEUED' and 1 or 0,
  'succeeded', outcome == 'SUCCEEDED' and 1 or 0, 'failed', outcome == 'FAILED' and 1 or 0)
if outcome == 'QUEUED' then
  redis.call('HDEL', jk, 'lo', 'lu')
  redis.call('HSET', jk, 'st', 'QUEUED')
  redis.call('PEXPIRE', jk, tonumber(ARGV[4]))  -- bounded, as at release
  log_change(KEYS[2], ARGV[8], outcome, {ARGV[7]})
  return {OK, outcome}
end
-- One command per kind of write (a call from Lua costs more than its work here):
-- the lease and any message left go in one HDEL, the outcome in one HSET.
drop_message(jk, {'lo', 'lu'})
local done = {'st', outcome, 'finished', now_ms(ARGV[1])}
if ARGV[6] ~= '' then done[5] = 'reason'; done[6] = ARGV[6] end
redis.call('HSET', jk, unpack(done))
local ttl = tonumber(ARGV[4])
if ik and ik ~= '' then ttl = math.max(ttl, tonumber(ARGV[5])) end
redis.call('PEXPIRE', jk, ttl)
log_change(KEYS[2], ARGV[8], outcome, {ARGV[7]})
return {OK, outcome}

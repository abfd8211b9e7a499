--[[ fail: record the final failure of a job that is not dead-lettered (state FAILED).

KEYS[1]  in-flight set     {p}:{s}:inflight
KEYS[2]  job record        {p}:{s}:job:<id>
KEYS[3]  released set      {p}:{s}:released
KEYS[4]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job id
ARGV[3]  ttl of the failed record, ms
ARGV[4]  start of the attempt that failed, epoch ms ('' = now)
ARGV[5]  execution owner token (worker side lease, `lo`; '' = no check)
ARGV[6]  '1' to append to the change log (a database mirrors the store), '' not
ARGV[7]  F, the number of record fields that follow
ARGV[8 .. 7+F]      field names (etype, emsg, tb, host, ...)
ARGV[8+F .. 7+2F]   their values ('' removes the field)

Returns {code, previous state}:
  OK           FAILED (previous state QUEUED, CLAIMED, RUNNING, or '' for a new record)
  WRONG_STATE  SCHEDULED (a retry is pending), CANCELLED or finished: nothing changed
  NOT_OWNER    RUNNING under another execution's lease: nothing changed
]]
-- @include "common"
-- @include "attempts"
-- @include "changes"
-- @include "ops"
-- @include "compact"

local jk = KEYS[2]
local st = redis.call('HGET', jk, 'st')
if st and not FAILABLE[st] then return {WRONG_STATE, st} end
if not owns(jk, st, ARGV[5]) then return {NOT_OWNER, st} end
local now = now_ms(ARGV[1])
local started = attempt_started(jk, st, ARGV[4], now)
set_fields(jk, 8, tonumber(ARGV[7]))
close_attempt(jk, 'FAILED', 'finished', started, now)
drop_message(jk)
redis.call('ZREM', KEYS[1], ARGV[2])
released_rem(KEYS[3], ARGV[2])
redis.call('PEXPIRE', jk, tonumber(ARGV[3]))
log_change(KEYS[4], ARGV[6], 'FAILED', {ARGV[2]})
stats_add(shard_base(jk), 'failed', 1, 'queued', st == 'QUEUED' and -1 or 0, 'running', st == 'RUNNING' and -1 or 0)
return {OK, st or ''}

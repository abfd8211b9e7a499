--[[ finish: end an execution: record its outcome and give the lease back.

KEYS[1]  job record        {p}:{s}:job:<id>
ARGV[1]  execution owner token (as given to start)
ARGV[2]  outcome: SUCCEEDED or FAILED (terminal: the record becomes the done
         marker and expires after its ttl), or QUEUED (the task re-queued
         itself, e.g. Celery's own retry: the next delivery may start it)
ARGV[3]  ttl of a finished record, ms (delayed_done_ttl_s)
ARGV[4]  ttl of a finished record that has an idempotency key, ms
         (delayed_idempotency_ttl_s; the longer of the two applies)
ARGV[5]  now, epoch ms ('' = the Redis server's TIME)
ARGV[6]  reason ('' = none), kept as 'reason'

Returns {code, state}:
   1  recorded; state = the outcome
   0  no record (it expired): nothing written
  -1  not this owner's any more (cancelled while running, or taken over after
      the lease passed); state = the current state, nothing changed
]]
-- @include "common"

local st, lo, ik = unpack(redis.call('HMGET', KEYS[1], 'st', 'lo', 'ik'))
if not st then return {0, ''} end
if st ~= 'RUNNING' or lo ~= ARGV[1] then return {-1, st} end
local outcome = ARGV[2]
redis.call('HDEL', KEYS[1], 'lo', 'lu')
if outcome == 'QUEUED' then
  redis.call('HSET', KEYS[1], 'st', 'QUEUED')
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))  -- bounded, as at release
  return {1, outcome}
end
redis.call('HSET', KEYS[1], 'st', outcome, 'finished', now_ms(ARGV[5]))
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'reason', ARGV[6]) end
redis.call('HDEL', KEYS[1], 'msg')
local ttl = tonumber(ARGV[3])
if ik and ik ~= '' then ttl = math.max(ttl, tonumber(ARGV[4])) end
redis.call('PEXPIRE', KEYS[1], ttl)
return {1, outcome}

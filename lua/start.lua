--[[ start: begin one execution of a delivered job (worker side), atomically.

Re-reads the authoritative state just before the task body runs and, when the
job may run, takes its execution lease: one execution at a time per job.

KEYS[1]  job record        {p}:{s}:job:<id>
ARGV[1]  execution owner token ("<hostname>|<pid>|<delivery tag>|<nonce>",
         unique per execution)
ARGV[2]  execution lease, ms (the owner extends it with extend_lease)
ARGV[3]  now, epoch ms ('' = the Redis server's TIME)
ARGV[4]  worker hostname (kept in the record as 'wk')

Returns {code, state, attempt, lease_until}:
   1  run: lease taken, state RUNNING; attempt = this execution's number
      (1 = first); lease_until = the lease deadline, epoch ms
   0  no record (sent with apply_async, or its record expired): run without
      the ledger
  -1  CANCELLED: do not run (announce it as revoked)
  -2  SUCCEEDED: a redelivery of a completed job: do not run
  -3  RUNNING under another execution's live lease (lease_until = its
      deadline): do not run now
  -4  any other state: do not run (FAILED, DEAD, EXPIRED, SKIPPED, or
      SCHEDULED: a stale delivery of a job scheduled again for a retry)
A RUNNING job whose lease has passed (its worker died) is taken over (1).
]]
-- @include "common"

local r = redis.call('HMGET', KEYS[1], 'st', 'lo', 'lu', 'att')
local st = r[1]
if not st then return {0, '', 0, 0} end
local att = tonumber(r[4] or 0)
if st == 'CANCELLED' then return {-1, st, att, 0} end
if st == 'SUCCEEDED' then return {-2, st, att, 0} end
local now = now_ms(ARGV[3])
local lu = tonumber(r[3] or 0)
if st == 'RUNNING' and r[2] ~= ARGV[1] and lu > now then return {-3, st, att, lu} end
if st ~= 'QUEUED' and st ~= 'CLAIMED' and st ~= 'RUNNING' then return {-4, st, att, 0} end
att = redis.call('HINCRBY', KEYS[1], 'att', 1)
lu = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'st', 'RUNNING', 'lo', ARGV[1], 'lu', lu, 'started', now, 'wk', ARGV[4])
-- A running job's record must outlive the run: the TTL set at release is for
-- records nobody starts; finish.lua sets the next one.
redis.call('PERSIST', KEYS[1])
return {1, 'RUNNING', att, lu}

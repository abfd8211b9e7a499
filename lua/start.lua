--[[ start: begin one execution of a delivered job (worker side), atomically.

Re-reads the authoritative state just before the task body runs and, when the
job may run, takes its execution lease: one execution at a time per job.

KEYS[1]  job record        {p}:{s}:job:<id>
KEYS[2]  released set      {p}:{s}:released
KEYS[3]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  execution owner token ("<hostname>|<pid>|<delivery tag>|<nonce>",
         unique per execution)
ARGV[3]  execution lease, ms (the owner extends it with extend_lease)
ARGV[4]  worker hostname (kept in the record as 'wk')
ARGV[5]  the message's generation (its `delayed_gen` header; '' = 0)
ARGV[6]  the job id
ARGV[7]  '1' to append to the change log (a database mirrors the store), '' not

Returns {code, state, attempt, lease_until, why}:
  OK           run: lease taken, state RUNNING; attempt = this execution's
               number (1 = first); lease_until = the lease deadline, epoch ms
  NOT_FOUND    no record (sent with apply_async, or its record expired): run
               without the execution record
  BUSY         RUNNING under another execution's live lease (lease_until = its
               deadline): do not run now
  WRONG_STATE  do not run; state says why: CANCELLED (announce it as revoked),
               SUCCEEDED (a redelivery of a completed job), FAILED, DEAD,
               EXPIRED, SKIPPED, or SCHEDULED (a stale delivery of a job
               scheduled again for a retry); why = 'superseded' when the
               message is of an earlier generation than the record (its job
               was cancelled and its idempotency key used again)
A RUNNING job whose lease has passed (its worker died) is taken over (OK).

The shard's stats (includes/ops.lua) count each start (with its start
lateness, now - due, unless it takes over a RUNNING job), the running and
queued gauges, and each delivery refused as a duplicate (not a cancelled one).

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"
-- @include "changes"
-- @include "ops"
-- @include "compact"

local jk = KEYS[1]
local st, lo, lu, att, gen, due = unpack(redis.call('HMGET', jk, 'st', 'lo', 'lu', 'att', 'gen', 'due'))
if not st then return {NOT_FOUND, '', 0, 0, ''} end
att = tonumber(att or 0)
local base = shard_base(jk)
if (tonumber(ARGV[5]) or 0) ~= (tonumber(gen) or 0) then
  stats_add(base, 'duplicates', 1)
  return {WRONG_STATE, st, att, 0, 'superseded'}
end
if st ~= 'QUEUED' and st ~= 'CLAIMED' and st ~= 'RUNNING' then
  if st ~= 'CANCELLED' then stats_add(base, 'duplicates', 1) end
  return {WRONG_STATE, st, att, 0, ''}
end
local now = now_ms(ARGV[1])
lu = tonumber(lu or 0)
if st == 'RUNNING' and lo ~= ARGV[2] and lu > now then return {BUSY, st, att, lu, ''} end
att = att + 1  -- written with the rest: one HSET (a call from Lua costs more than its work here)
lu = now + tonumber(ARGV[3])
redis.call('HSET', jk, 'st', 'RUNNING', 'lo', ARGV[2], 'lu', lu, 'started', now, 'wk', ARGV[4], 'att', att)
drop_message(jk)  -- started: the reconciler will not send it again
released_rem(KEYS[2], ARGV[6])
log_change(KEYS[3], ARGV[7], 'RUNNING', {ARGV[6]})
-- A running job's record must outlive the run: the TTL set at release is for
-- records nobody starts; finish.lua sets the next one.
redis.call('PERSIST', jk)
if st == 'RUNNING' then
  stats_add(base, 'started', 1)  -- a takeover: it was counted running already
else
  stats_add(base, 'started', 1, 'running', 1, 'queued', st == 'QUEUED' and -1 or 0)
  if due then
    local h = late_new()
    late_add(h, now - tonumber(due))
    late_save(base, 'sl', h)
  end
end
return {OK, 'RUNNING', att, lu, ''}

--[[ extend_lease: keep a running execution's lease alive (worker heartbeat).

KEYS[1]  job record        {p}:{s}:job:<id>
KEYS[2]  optional: kombu's unacked index (global_keyprefix + 'unacked_index'),
         given when the broker is Redis on this server (direct path)
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  execution owner token (as given to start)
ARGV[3]  execution lease, ms: the new deadline is now + this
ARGV[4]  with KEYS[2]: the message's delivery tag
ARGV[5]  with KEYS[2]: the score to give it, epoch seconds (kombu's own clock
         is the worker's time.time(), so the caller passes it)

With KEYS[2], an extended lease also refreshes the message's entry in kombu's
unacked index (ZADD XX: only while kombu still tracks it), so kombu's restore
sweep does not redeliver a message whose task is still running.

Returns {code, state, lease_until}:
  OK          extended; lease_until = the new deadline, epoch ms
  NOT_FOUND   no record (it expired): nothing to extend
  NOT_OWNER   the lease is lost: the job is no longer RUNNING under this owner
              (cancelled with terminate, or taken over after the lease
              passed); state says what it is now. Nothing changed.

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"

local st, lo = unpack(redis.call('HMGET', KEYS[1], 'st', 'lo'))
if not st then return {NOT_FOUND, '', 0} end
if st ~= 'RUNNING' or lo ~= ARGV[2] then return {NOT_OWNER, st, 0} end
local lu = now_ms(ARGV[1]) + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'lu', lu)
if KEYS[2] then redis.call('ZADD', KEYS[2], 'XX', ARGV[5], ARGV[4]) end
return {OK, st, lu}

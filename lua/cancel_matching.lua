--[[ cancel_matching: cancel the scheduled jobs of one shard that match a task
or queue and a due window, up to a limit per call.

The jobs are read from the pending index (includes/ops.lua), so the cost is
bounded by what matches. Each is cancelled as cancel.lua cancels a SCHEDULED
job: out of the due index (and a pause's held set), CANCELLED, its message
dropped, its record expiring after the record ttl.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  change log        {p}:{s}:changes (only when a database mirrors the store)
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  ttl of a cancelled record, ms
ARGV[5]  due from, epoch ms, inclusive ('-inf' = no bound)
ARGV[6]  due to, epoch ms, inclusive ('+inf' = no bound)
ARGV[7]  most jobs to cancel in this call
ARGV[8..] index parts (`<n>:<task>:<queue>`) to look in

Returns the ids cancelled (fewer than ARGV[7]: nothing more matches).

Runs when Redis is at maxmemory (@flags below): it frees memory.
]]
-- @flags allow-oom
-- @include "common"
-- @include "due_index"
-- @include "ops"
-- @include "shaping"
-- @include "changes"
-- @include "compact"

local now = now_ms(ARGV[1])
local prefix, bucket_ms, ttl, limit = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[7])
local base = shard_base(KEYS[1])
local out = {}
for i = 8, #ARGV do
  local left = limit - #out
  if left <= 0 then break end
  local k = base .. 'ix:' .. ARGV[i]
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', k, ARGV[5], ARGV[6], 'LIMIT', 0, left)) do
    local jk = prefix .. id
    redis.call('ZREM', k, id)
    local st, due = unpack(redis.call('HMGET', jk, 'st', 'due'))
    if st == 'SCHEDULED' then
      due_rem(KEYS[1], KEYS[2], id, tonumber(due), bucket_ms)
      redis.call('ZREM', base .. 'held', id)
      shaping_forget(base, jk, id)
      redis.call('HSET', jk, 'st', 'CANCELLED', 'cancelled', now)
      drop_message(jk)
      redis.call('PEXPIRE', jk, ttl)
      out[#out + 1] = id
    end
  end
  if redis.call('EXISTS', k) == 0 then redis.call('SREM', base .. 'ixs', ARGV[i]) end
end
stats_add(base, 'cancelled', #out)
if KEYS[3] then log_change(KEYS[3], '1', 'CANCELLED', out) end
return out

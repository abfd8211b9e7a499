-- Dead-letter helpers; the loader inlines this file where a script says
-- `-- @include "dlq"`. A dead letter is its job record (st=DEAD) indexed in
-- the shard's dlq sorted set by its time of death (epoch ms).

-- Forget one dead letter: its index entry, and its record while still DEAD
-- (a record requeued or replaced meanwhile is not ours to delete).
local function dlq_drop(dlq, prefix, id)
  redis.call('ZREM', dlq, id)
  local jk = prefix .. id
  if redis.call('HGET', jk, 'st') == 'DEAD' then redis.call('DEL', jk) end
end

-- Bound the shard's dead letters: drop those that died at or before `cutoff`
-- (at most `limit` per call, so one call stays short), then the oldest ones
-- beyond `max_len`. Returns how many were dropped.
local function dlq_trim(dlq, prefix, cutoff, max_len, limit)
  local n = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', dlq, '-inf', cutoff, 'LIMIT', 0, limit)) do
    dlq_drop(dlq, prefix, id)
    n = n + 1
  end
  if max_len >= 0 then
    local over = redis.call('ZCARD', dlq) - max_len
    if over > 0 then
      for _, id in ipairs(redis.call('ZRANGE', dlq, 0, math.min(over, limit) - 1)) do
        dlq_drop(dlq, prefix, id)
        n = n + 1
      end
    end
  end
  return n
end

-- Set the record fields given as parallel name/value lists from ARGV[first ..]:
-- a non-empty value is stored, an empty one removes the field.
local function set_fields(jk, first, nf)
  for f = 0, nf - 1 do
    local name, value = ARGV[first + f], ARGV[first + nf + f]
    if value == '' then redis.call('HDEL', jk, name) else redis.call('HSET', jk, name, value) end
  end
end

-- When the failed attempt started: the worker side's `started` (Redis clock)
-- while it is RUNNING, else the caller's time ('' = now).
local function attempt_started(jk, st, arg, now)
  if st == 'RUNNING' then
    local s = redis.call('HGET', jk, 'started')
    if s then return s end
  end
  if arg ~= '' then return arg end
  return now
end

-- Whether the caller may end this execution: '' skips the check; a RUNNING
-- job whose lease (`lo`, worker side) belongs to another execution is not ours.
local function owns(jk, st, owner)
  if owner == '' or st ~= 'RUNNING' then return true end
  local lo = redis.call('HGET', jk, 'lo')
  return (not lo) or lo == owner
end

-- Give the execution lease back (worker side fields).
local function drop_lease(jk)
  redis.call('HDEL', jk, 'lo', 'lu')
end

-- End the failed attempt: the job's new state, when (`at_field`), the attempt times.
local function close_attempt(jk, state, at_field, started, now)
  drop_lease(jk)
  redis.call('HSET', jk, 'st', state, at_field, now, 'last_at', started)
  redis.call('HSETNX', jk, 'first_at', started)
  redis.call('HSETNX', jk, 'created', now)
end

-- States a failing attempt may leave: released to the queue (QUEUED, or CLAIMED
-- while the publisher has not acknowledged it yet) or RUNNING (worker side).
local FAILABLE = {QUEUED = true, CLAIMED = true, RUNNING = true}

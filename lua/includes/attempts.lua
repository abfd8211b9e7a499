-- Ending a failed attempt (`-- @include "attempts"`): retry.lua, fail.lua and
-- dead.lua write the failure's fields and close the attempt with these.

-- Set the record fields given as parallel name/value lists from ARGV[first ..]:
-- a non-empty value is stored, an empty one removes the field.
local function set_fields(jk, first, nf)
  for f = 0, nf - 1 do
    local name, value = ARGV[first + f], ARGV[first + nf + f]
    if value == '' then redis.call('HDEL', jk, name) else redis.call('HSET', jk, name, value) end
    -- a message given (or removed) replaces a compact record's own part of it
    if name == 'msg' then redis.call('HDEL', jk, 'a', 'k', 'b', 'e', 'i', 'r', 'pa', 'tg') end
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

-- Helpers every script includes first (`-- @include "common"`); the loader
-- inlines the file. Times are integer epoch milliseconds.
--
-- Conventions of every script:
--   ARGV[1] is `now`, epoch ms: '' means the Redis server's clock (TIME); a
--   test passes any time it likes.
--   A script that acts on one job replies {code, state, ...} with a code
--   from this table (mirrored in Python as celery_delayed.vocab.Reply):
--      1  OK           done
--      2  UNCHANGED    nothing to do: the job is in the wanted state already
--      0  NOT_FOUND    no record under that id
--     -1  WRONG_STATE  the record's state does not allow it (state = which)
--     -2  NOT_OWNER    the caller does not hold the lease it acts under (a
--                      shard's lease, or a running job's execution lease)
--     -3  BUSY         another execution holds the job's live execution lease
--     -4  NO_MESSAGE   a dead letter without a stored message (not requeueable)
local OK, UNCHANGED, NOT_FOUND, WRONG_STATE, NOT_OWNER, BUSY, NO_MESSAGE = 1, 2, 0, -1, -2, -3, -4

-- Keep a compact template (key `tk`) alive for at least `want` ms more. It is
-- extended with an eighth more, so that a stream of jobs due at a steady delay
-- sends PEXPIRE once per eighth of that delay rather than on every call.
local function keep_template(tk, want)
  if redis.call('PTTL', tk) < want then redis.call('PEXPIRE', tk, want + math.floor(want / 8)) end
end

-- The Redis server's clock, unless the caller passed an explicit time (tests).
local function now_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A due time from its spec: '<ms>' (epoch ms) or '+<ms>' (a delay added to now).
local function due_from(spec, now)
  if string.byte(spec, 1) == 43 then return now + tonumber(string.sub(spec, 2)) end  -- 43: '+'
  return tonumber(spec)
end

-- The caller must hold the shard's lease ("<owner>|<fence>"); '' skips the check.
local function lease_ok(lease_key, owner, fence)
  if owner == '' then return true end
  return redis.call('GET', lease_key) == (owner .. '|' .. fence)
end

-- The shard argument of a script that stores a new job or schedule:
-- '<shard>' or '<shard>/<count>', the shard count the caller placed it with.
-- A reshard seals each shard against the old count ({p}:{s}:sealed holds it):
-- a write placed with that count is refused (the caller reads the layout again
-- and places it anew). Returns the shard and whether the write is refused.
local function placed(spec, any_key)
  local s, n = string.match(spec, '^(%d+)/(%d+)$')
  if not s then return spec, false end
  local base = string.sub(any_key, 1, string.find(any_key, '}', 1, true) + 1)
  return s, redis.call('GET', base .. 'sealed') == n
end

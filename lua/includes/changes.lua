-- What the reconciler and the database mirror need from every script that
-- changes a job's state (`-- @include "changes"`).
--
-- The released set ({p}:{s}:released, job id -> due time, or the time it was
-- last released again) holds the jobs released and not started yet: the
-- reconciler looks there for messages the broker lost.
-- The change log ({p}:{s}:changes, a stream) holds, when a database mirrors
-- the store, one entry per script call and new state: 'st' and the ids
-- ('\n'-joined: ids have no control characters). `log` is the caller's '1'
-- (a database is configured) or '' (nothing is appended).

local function released_add(released, id, score)
  redis.call('ZADD', released, score, id)
end

local function released_rem(released, id)
  redis.call('ZREM', released, id)
end

local function log_change(stream, log, st, ids)
  if log ~= '1' or #ids == 0 then return end
  redis.call('XADD', stream, '*', 'st', st, 'ids', table.concat(ids, '\n'))
end

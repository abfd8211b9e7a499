-- The due index of one shard (`-- @include "due_index"`): a sorted set of job
-- ids scored by due time, or, with time buckets (bucket_ms > 0), one sorted
-- set per bucket plus an index of the buckets; and the shard's `next` key,
-- the earliest due time a sleeping scheduler knows of.

-- The sorted set that indexes a job due at `due`: the shard's one due set,
-- or the time bucket that holds `due` when bucketing is on.
local function due_key(due_base, due, bucket_ms)
  if bucket_ms <= 0 then return due_base end
  return due_base .. ':' .. tostring(due - (due % bucket_ms))
end

local function due_add(due_base, buckets, id, due, bucket_ms)
  local k = due_key(due_base, due, bucket_ms)
  redis.call('ZADD', k, due, id)
  if bucket_ms > 0 then redis.call('ZADD', buckets, due - (due % bucket_ms), k) end
end

local function due_rem(due_base, buckets, id, due, bucket_ms)
  local k = due_key(due_base, due, bucket_ms)
  local n = redis.call('ZREM', k, id)
  if bucket_ms > 0 and n == 1 and redis.call('EXISTS', k) == 0 then
    redis.call('ZREM', buckets, k)
  end
  return n
end

-- Earliest due time in the shard, or nil when it holds no scheduled job.
local function earliest(due_base, buckets, bucket_ms)
  if bucket_ms <= 0 then
    local r = redis.call('ZRANGE', due_base, 0, 0, 'WITHSCORES')
    if #r == 0 then return nil end
    return tonumber(r[2])
  end
  while true do
    local b = redis.call('ZRANGE', buckets, 0, 0)
    if #b == 0 then return nil end
    local r = redis.call('ZRANGE', b[1], 0, 0, 'WITHSCORES')
    if #r > 0 then return tonumber(r[2]) end
    redis.call('ZREM', buckets, b[1])  -- an emptied bucket
  end
end

-- Earliest due time strictly after `t` in the shard, or nil.
local function earliest_after(due_base, buckets, bucket_ms, t)
  local after = string.format('(%d', t)
  if bucket_ms <= 0 then
    local r = redis.call('ZRANGEBYSCORE', due_base, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if #r == 0 then return nil end
    return tonumber(r[2])
  end
  -- From the bucket that holds t on, in order: the first bucket with a job after t has the earliest.
  local from = t - (t % bucket_ms)
  while true do
    local bks = redis.call('ZRANGEBYSCORE', buckets, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 8)
    if #bks == 0 then return nil end
    for i = 1, #bks, 2 do
      local r = redis.call('ZRANGEBYSCORE', bks[i], after, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
      if #r > 0 then return tonumber(r[2]) end
    end
    from = string.format('(%d', tonumber(bks[#bks]))
  end
end

-- The next due time a release (or claim) that put debounce jobs back reports
-- (release_due.lua): `now` when its batch was full and also moved other jobs
-- (more may wait behind the ones put back), else the earliest due time past
-- its look-ahead `upto` (every job left before that is one put back: the
-- reply's `hold` tells when the earliest of those is due).
local function next_visit(due_base, buckets, bucket_ms, now, upto, more)
  if more then return now end
  return earliest_after(due_base, buckets, bucket_ms, upto)
end

-- Remove and return up to `limit` job ids due at or before `now`, earliest
-- first. ZRANGEBYSCORE then ZREMRANGEBYRANK removes exactly the members read,
-- in one command, because they are the lowest-ranked ones.
local function take_due(due_base, buckets, bucket_ms, now, limit)
  local out = {}
  if bucket_ms <= 0 then
    out = redis.call('ZRANGEBYSCORE', due_base, '-inf', now, 'LIMIT', 0, limit)
    if #out > 0 then redis.call('ZREMRANGEBYRANK', due_base, 0, #out - 1) end
    return out
  end
  -- A bucket in the index holds at least one job (emptied buckets leave it),
  -- so `limit` buckets are enough: never read every overdue bucket's name.
  local bks = redis.call('ZRANGEBYSCORE', buckets, '-inf', now, 'LIMIT', 0, limit)
  for _, k in ipairs(bks) do
    local left = limit - #out
    if left <= 0 then break end
    local ids = redis.call('ZRANGEBYSCORE', k, '-inf', now, 'LIMIT', 0, left)
    if #ids > 0 then redis.call('ZREMRANGEBYRANK', k, 0, #ids - 1) end
    for _, id in ipairs(ids) do out[#out + 1] = id end
    if redis.call('EXISTS', k) == 0 then redis.call('ZREM', buckets, k) end
  end
  return out
end

-- Record the new earliest due time of the shard; with none left, forget it.
local function set_next(next_key, e)
  if e then redis.call('SET', next_key, e) else redis.call('DEL', next_key) end
end

-- Wake the scheduler when `due` is earlier than the time it is sleeping toward.
local function maybe_wake(next_key, channel, shard, due)
  local nxt = redis.call('GET', next_key)
  if (not nxt) or due < tonumber(nxt) then
    redis.call('SET', next_key, due)
    redis.call('PUBLISH', channel, shard .. ':' .. due)
  end
end

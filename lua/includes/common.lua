-- Helpers shared by the scripts; the loader inlines this file where a script
-- says `-- @include "common"`. Times are integer epoch milliseconds.

-- The Redis server's clock, unless the caller passed an explicit time (tests).
local function now_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A due time from its spec: '<ms>' (epoch ms) or '+<ms>' (a delay added to now).
local function due_from(spec, now)
  if string.sub(spec, 1, 1) == '+' then return now + tonumber(string.sub(spec, 2)) end
  return tonumber(spec)
end

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

-- The caller must hold the shard's lease ("<owner>|<fence>"); '' skips the check.
local function lease_ok(lease_key, owner, fence)
  if owner == '' then return true end
  return redis.call('GET', lease_key) == (owner .. '|' .. fence)
end

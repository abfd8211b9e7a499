-- What operators see and steer (`-- @include "ops"`): the shard's counters and
-- lateness histograms, its pending index by task and queue, its pause flags.
-- Each key is derived from a key of the shard the script already holds (its
-- `{p}:{s}:` base), so it carries the shard's hash tag: every script still
-- touches one slot. Python formats the same names (store/keys.py).
--
--   {p}:{s}:stats    HASH  counters (scheduled, released, cancelled, retried, dead,
--                          expired, skipped, duplicates, started, succeeded, failed,
--                          requeued, promoted); gauges kept by +/-: queued (released,
--                          not started), running; histograms: rl:<i> / sl:<i> (release /
--                          start lateness, bucket i of LATE_MS, not cumulative), rl:sum / sl:sum (ms)
--   {p}:{s}:ix:<n>:<task>:<queue>  ZSET  scheduled jobs of one task and queue: id -> due
--                          (<n> = the task name's length in bytes, so the key is unambiguous)
--   {p}:{s}:ixs      SET   the `<n>:<task>:<queue>` part of each of the shard's ix keys
--   {p}:{s}:paused   HASH  pause flags: 'all', 'task:<name>', 'queue:<name>' -> since (ms)
--   {p}:{s}:held     ZSET  due jobs a pause holds back (still SCHEDULED): id -> due

-- Upper bounds of the lateness histogram buckets, ms (the last bucket is +Inf).
-- Mirrored in celery_delayed/store/stats.py (LATENESS_BOUNDS_MS).
local LATE_MS = {5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000, 1800000}

-- `{p}:{s}:` of any key of the shard (a prefix never holds a brace).
local function shard_base(key)
  return string.sub(key, 1, string.find(key, '}', 1, true) + 1)
end

-- Add counts to the shard's stats: stats_add(base, 'released', 3, 'queued', 3, ...); zeros are skipped.
local function stats_add(base, ...)
  local a = {...}
  for i = 1, #a, 2 do
    if a[i + 1] ~= 0 then redis.call('HINCRBY', base .. 'stats', a[i], a[i + 1]) end
  end
end

-- A lateness histogram of one call: late_add per job, late_save once at the end.
local function late_new() return {sum = 0} end
local function late_add(h, ms)
  ms = math.max(0, math.floor(ms))
  local lo, hi = 1, #LATE_MS + 1  -- the first bucket whose bound is >= ms (binary search)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if ms <= LATE_MS[mid] then hi = mid else lo = mid + 1 end
  end
  h[lo] = (h[lo] or 0) + 1
  h.sum = h.sum + ms
end
local function late_save(base, name, h)
  for i = 1, #LATE_MS + 1 do
    if h[i] then redis.call('HINCRBY', base .. 'stats', name .. ':' .. i, h[i]) end
  end
  if h.sum > 0 then redis.call('HINCRBY', base .. 'stats', name .. ':sum', h.sum) end
end

-- The pending index: one sorted set per task and queue.
local function ix_part(task, q)
  task, q = task or '', q or ''
  return #task .. ':' .. task .. ':' .. q
end
local function ix_add(base, task, q, id, due)
  local part = ix_part(task, q)
  redis.call('ZADD', base .. 'ix:' .. part, due, id)
  redis.call('SADD', base .. 'ixs', part)
end
local function ix_rem(base, task, q, id)
  local k = base .. 'ix:' .. ix_part(task, q)
  redis.call('ZREM', k, id)
end
-- Many jobs of one call: ix_push per job, then ix_flush once ('add' pushes due, id; 'rem' pushes id).
-- Lists are kept per task, then per queue: no string is built per job.
local function ix_push(b, task, q, a, c)
  task, q = task or '', q or ''
  local byq = b[task]
  if not byq then byq = {}; b[task] = byq end
  local l = byq[q]
  if not l then l = {}; byq[q] = l end
  l[#l + 1] = a
  if c then l[#l + 1] = c end
end
local function ix_flush(base, b, op)
  for task, byq in pairs(b) do
    for q, l in pairs(byq) do
      local part = ix_part(task, q)
      local k = base .. 'ix:' .. part
      for i = 1, #l, 512 do
        redis.call(op == 'add' and 'ZADD' or 'ZREM', k, unpack(l, i, math.min(i + 511, #l)))
      end
      if op == 'add' then
        redis.call('SADD', base .. 'ixs', part)
      elseif redis.call('EXISTS', k) == 0 then
        redis.call('SREM', base .. 'ixs', part)
      end
    end
  end
end

-- The shard's pause flags as a set, or nil when nothing is paused (one HGETALL).
local function pauses(base)
  local f = redis.call('HGETALL', base .. 'paused')
  if #f == 0 then return nil end
  local t = {}
  for i = 1, #f, 2 do t[f[i]] = true end
  return t
end
local function is_paused(p, task, q)
  return p['task:' .. (task or '')] or p['queue:' .. (q or '')]
end

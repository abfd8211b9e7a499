--[[ promote: make scheduled jobs of one shard due now ("run now").

Each job found SCHEDULED with a due time after now gets due = now: the
scheduler releases it at once (a paused task or queue still holds it back).
Either the jobs named by id, or up to a limit of the jobs in the given
pending-index parts (one task, or one queue), read from the index: the cost is
bounded by what matches.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  change log        {p}:{s}:changes (only when a database mirrors the store)
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number
ARGV[6]  most jobs to promote in this call
ARGV[7]  'ids': ARGV[8..] are job ids; 'index': ARGV[8..] are index parts
         (`<n>:<task>:<queue>`, see includes/ops.lua)

Returns {promoted, now, then per job named by id: its state ('' when there
is no such job)}. A job due already counts as promoted; nothing changes for it.
]]
-- @include "common"
-- @include "due_index"
-- @include "ops"
-- @include "shaping"
-- @include "changes"
-- @include "eta"
-- @include "compact"

local now = now_ms(ARGV[1])
local prefix, bucket_ms, limit = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[6])
local base = shard_base(KEYS[1])
local out, n, moved, logged = {0, now}, 0, 0, {}

local function promote(id)
  local jk = prefix .. id
  local st, due, task, q, tp = unpack(redis.call('HMGET', jk, 'st', 'due', 'task', 'q', 'tp'))
  task, q = route_of(base, task, q, tp)
  if st == 'SCHEDULED' then
    n = n + 1
    if tonumber(due) > now then
      due_rem(KEYS[1], KEYS[2], id, tonumber(due), bucket_ms)
      due_add_job(KEYS[1], KEYS[2], jk, id, now, bucket_ms)
      redis.call('HSET', jk, 'due', now)
      local msg = redis.call('HGET', jk, 'msg')  -- what request.eta shows
      if msg then redis.call('HSET', jk, 'msg', with_eta(msg, now))
      elseif tp then redis.call('HSET', jk, 'e', '"' .. iso_utc(now) .. '"') end
      ix_add(base, task, q, id, now)
      logged[#logged + 1] = id
      moved = moved + 1
    end
  end
  return st or ''
end

if ARGV[7] == 'ids' then
  for i = 8, math.min(#ARGV, 7 + limit) do out[#out + 1] = promote(ARGV[i]) end
else
  for i = 8, #ARGV do
    local left = limit - n
    if left <= 0 then break end
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', base .. 'ix:' .. ARGV[i], '(' .. now, '+inf', 'LIMIT', 0, left)) do
      promote(id)
    end
  end
end
if moved > 0 then
  maybe_wake(KEYS[3], ARGV[4], ARGV[5], now)
  stats_add(base, 'promoted', moved)
  if KEYS[4] then log_change(KEYS[4], '1', 'SCHEDULED', logged) end
end
out[1] = n
return out

--[[ rerelease: send again the jobs of one shard whose message the broker lost.

The candidates are released jobs that have not started long after their due
time (the caller picked them from the released set). Each is checked again
here, atomically, and sent again only when its message is nowhere:

- direct path: not held by a worker (kombu's unacked hash has no entry for
  its delivery tag, or the entry is older than ARGV[12]: a worker that took
  it that long ago and has not started it lost it, e.g. with its broker
  connection, and kombu would restore it only after its visibility timeout)
  and not waiting in its queue (each destination list is
  empty, or its oldest message, the next one a worker takes, was released
  after this job: the lists are FIFO, so this job's message is not in it);
  then its stored message is pushed again, exactly as release_due pushes it;
- publish path: the caller asked the broker that the queue holds nothing;
  the job goes back to the due set, due now, and is claimed and published
  again as usual.

At most `max` copies per job (`rr` counts them). A copy that survives next to
the original is harmless: the worker side runs a job once.

KEYS[1]  released set      {p}:{s}:released
KEYS[2]  due set base      {p}:{s}:due
KEYS[3]  bucket index      {p}:{s}:buckets
KEYS[4]  next due key      {p}:{s}:next
KEYS[5]  change log        {p}:{s}:changes
KEYS[6]  direct path: kombu's unacked hash (global_keyprefix + 'unacked')
KEYS[7]  direct path: kombu's unacked index (global_keyprefix + 'unacked_index': tag -> delivery time, s)
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  'direct' or 'publish'
ARGV[4]  most copies per job
ARGV[5]  kombu global_keyprefix
ARGV[6]  kombu's dead-letter queue ('' for none)
ARGV[7]  the store's key prefix (to find the record of a queue's oldest message)
ARGV[8]  bucket width, ms (0 = one due set)
ARGV[9]  wake channel      {p}:wake
ARGV[10] shard number
ARGV[11] '1' to append to the change log (a database mirrors the store), '' not
ARGV[12] ms after which a delivered, unstarted message counts as lost by its worker
ARGV[13..] job ids

Returns {OK, then per job: id, outcome}: 'rereleased'; 'held' (a worker has
it) or 'waiting' (in its queue): checked again later; 'exhausted' (`max`
copies sent: left alone); 'gone' (started, finished, cancelled or expired
meanwhile: dropped from the released set).
]]
-- @flags allow-oom
-- @include "common"
-- @include "due_index"
-- @include "changes"
-- @include "destination"
-- @include "ops"
-- @include "shaping"
-- @include "eta"
-- @include "compact"

local now = now_ms(ARGV[1])
local prefix, mode, max = ARGV[2], ARGV[3], tonumber(ARGV[4])
local gkp, dead_queue, store_prefix = ARGV[5], ARGV[6], ARGV[7]
local bucket_ms = tonumber(ARGV[8])
local out, again, back = {OK}, {}, {}

-- The release time of the next message a worker takes from `list` (its tail):
-- nil when the list is empty; -1 when it cannot be told (not one of ours, or
-- its record is gone): then this job may be waiting behind it.
local function oldest_release(list)
  local tail = redis.call('LINDEX', list, -1)
  if not tail then return nil end
  local ok, env = pcall(cjson.decode, tail)
  if not ok or type(env) ~= 'table' or type(env.headers) ~= 'table' then return -1 end
  local h = env.headers
  if h.delayed_store ~= store_prefix or h.delayed_shard == nil or type(h.id) ~= 'string' then return -1 end
  local rel = redis.call('HGET', store_prefix .. ':{' .. tostring(h.delayed_shard) .. '}:job:' .. h.id, 'released')
  return tonumber(rel) or -1
end

-- lk, bx, rk, ps, q of a job: its record's, or (compact) its template's.
local function route(jk)
  local x = redis.call('HMGET', jk, 'lk', 'bx', 'rk', 'ps', 'q', 'tp')
  if not (x[1] or x[2]) and x[6] then
    local t = template(shard_base(jk), x[6])
    if t then return {t.r.lk or false, t.r.bx or false, t.r.rk or false, t.r.ps or false, t.r.q or x[5]} end
  end
  return x
end

local function where(id, jk, r)
  local st, msg, rr, released = r[1], r[2], tonumber(r[3] or 0), tonumber(r[4] or 0)
  if st ~= 'QUEUED' or r[5] or not msg then return 'gone' end
  if rr >= max then return 'exhausted' end
  if mode ~= 'direct' then return 'lost' end
  local ok, env = pcall(cjson.decode, msg)
  if ok and type(env) == 'table' and type(env.properties) == 'table' and KEYS[6] then
    local tag = tostring(env.properties.delivery_tag)
    if redis.call('HEXISTS', KEYS[6], tag) == 1 then
      local at = KEYS[7] and tonumber(redis.call('ZSCORE', KEYS[7], tag))
      if not at or at * 1000 > now - tonumber(ARGV[12]) then return 'held' end
    end
  end
  local x = route(jk)
  for _, list in ipairs(dest_lists(gkp, x[1], x[2], x[3], x[4], x[5], dead_queue)) do
    local oldest = oldest_release(list)
    if oldest and oldest <= released then return 'waiting' end
  end
  return 'lost'
end

for i = 13, #ARGV do
  local id = ARGV[i]
  local jk = prefix .. id
  local r = redis.call('HMGET', jk, 'st', 'msg', 'rr', 'released', 'started', 'tg')
  if not r[2] and r[6] then r[2] = message_of(shard_base(jk), jk, id, r[6]) end  -- compact: as it went out
  local outcome = where(id, jk, r)
  if outcome == 'gone' or outcome == 'exhausted' then
    redis.call('ZREM', KEYS[1], id)
  elseif outcome == 'held' or outcome == 'waiting' then
    redis.call('ZADD', KEYS[1], now, id)  -- look again in another requeue_after
  elseif mode == 'direct' then
    local x = route(jk)
    for _, list in ipairs(dest_lists(gkp, x[1], x[2], x[3], x[4], x[5], dead_queue)) do
      redis.call('LPUSH', list, r[2])
    end
    redis.call('HINCRBY', jk, 'rr', 1)
    redis.call('HSET', jk, 'released', now)
    redis.call('ZADD', KEYS[1], now, id)
    again[#again + 1] = id
    outcome = 'rereleased'
  else
    redis.call('HINCRBY', jk, 'rr', 1)
    redis.call('HSET', jk, 'st', 'SCHEDULED', 'due', now)
    redis.call('HDEL', jk, 'released')
    redis.call('PERSIST', jk)
    redis.call('ZREM', KEYS[1], id)
    due_add_job(KEYS[2], KEYS[3], jk, id, now, bucket_ms)
    local task, q = unpack(redis.call('HMGET', jk, 'task', 'q'))
    ix_add(shard_base(KEYS[2]), task, q, id, now)  -- pending again: in the index, out of the queued gauge
    back[#back + 1] = id
    outcome = 'rereleased'
  end
  out[#out + 1] = id
  out[#out + 1] = outcome
end
if #back > 0 then
  maybe_wake(KEYS[4], ARGV[9], ARGV[10], now)
  stats_add(shard_base(KEYS[2]), 'queued', -#back)
end
log_change(KEYS[5], ARGV[11], 'SCHEDULED', back)
return out

--[[ pause: set or clear pause flags of one shard; on resume, put held jobs back.

A pause stops release for what it names: 'all', 'task:<name>' or
'queue:<name>' (includes/ops.lua). The jobs stay SCHEDULED: release_due and
claim_due release nothing while 'all' is set, and move a due job of a paused
task or queue to the shard's held set. A resume clears the flags and moves
held jobs back to the due set with their own due time, so they are released
at once and the misfire policy (max_lateness) applies to them as to any late
job; a job still paused by another flag stays held. The caller pauses or
resumes every shard.

KEYS[1]  pause flags       {p}:{s}:paused
KEYS[2]  held set          {p}:{s}:held
KEYS[3]  due set base      {p}:{s}:due
KEYS[4]  bucket index      {p}:{s}:buckets
KEYS[5]  next due key      {p}:{s}:next
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number
ARGV[6]  'pause' or 'resume'
ARGV[7]  resume: most held jobs to look at in this call
ARGV[8]  resume: rank in the held set to start at (jobs before it are still paused)
ARGV[9..] the flags to set or clear; a resume with none clears every flag

Returns {moved, next}: held jobs put back in the due set, and the rank to
pass as ARGV[8] next time (-1: the held set has been looked through).
]]
-- @include "common"
-- @include "due_index"
-- @include "ops"
-- @include "shaping"
-- @include "compact"

local now = now_ms(ARGV[1])
if ARGV[6] == 'pause' then
  for i = 9, #ARGV do redis.call('HSET', KEYS[1], ARGV[i], now) end
  return {0, -1}
end
if #ARGV < 9 then
  redis.call('DEL', KEYS[1])
else
  redis.call('HDEL', KEYS[1], unpack(ARGV, 9))
end
local base, prefix, bucket_ms = shard_base(KEYS[1]), ARGV[2], tonumber(ARGV[3])
local p = pauses(base)
local limit, at = tonumber(ARGV[7]), tonumber(ARGV[8])
local ids = redis.call('ZRANGE', KEYS[2], at, at + limit - 1)
local moved, kept = 0, 0
for _, id in ipairs(ids) do
  local st, due, task, q, tp = unpack(redis.call('HMGET', prefix .. id, 'st', 'due', 'task', 'q', 'tp'))
  task, q = route_of(base, task, q, tp)
  if st == 'SCHEDULED' and p and (p.all or is_paused(p, task, q)) then
    kept = kept + 1
  else
    redis.call('ZREM', KEYS[2], id)
    if st == 'SCHEDULED' then
      due_add_job(KEYS[3], KEYS[4], prefix .. id, id, tonumber(due), bucket_ms)
      moved = moved + 1
    end
  end
end
local e = earliest(KEYS[3], KEYS[4], bucket_ms)
set_next(KEYS[5], e)
if e and not (p and p.all) then redis.call('PUBLISH', ARGV[4], ARGV[5] .. ':' .. e) end
if #ids < limit then return {moved, -1} end
return {moved, at + kept}

--[[ put_schedule: create or replace a recurring schedule's definition (one shard).

A schedule lives in the shard of its name (every occurrence too, by shard
key): its definition, its cursor and its recent occurrences.

KEYS[1]  schedule hash     {p}:{s}:sched:<name>
KEYS[2]  shard's names     {p}:{s}:scheds
KEYS[3]  occurrences       {p}:{s}:occ:<name>   ZSET occurrence job id -> fire time, ms
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  name
ARGV[3]  definition, JSON (task, spec, args, kwargs, options, timezone, misfire, ...)
ARGV[4]  source: 'config' (from delayed_schedule) or 'api' (a run-time change)
ARGV[5]  config: the config entry's hash; api: ''
ARGV[6]  config: when the writing scheduler started, epoch ms ('' for api)
ARGV[7]  a new random epoch: kept by a schedule that exists, set by one that
         does not (occurrence ids derive from it, so a schedule removed and
         added again never meets its old occurrences' records)
ARGV[8]  '<shard>/<shard count>' the caller placed it in (a reshard's seal)
ARGV[9]  the cursor and the origin, epoch ms ('' = now, and the origin kept): occurrences
         start with the first fire time after it, and an interval counts its periods from
         it (a schedule imported from another scheduler, which ran it last then)
ARGV[10] paused: '1' to write it paused, '' to leave the flag as it is

With source 'config' nothing changes when the stored config hash equals
ARGV[5] (a run-time change wins over the config until the config entry itself
changes), nor when a scheduler started later than ARGV[6] wrote the stored
one (during a rolling deploy an old scheduler never undoes a new config); an
api write keeps the stored config hash. A write bumps the
version (occurrence ids derive from name, version and fire time), resumes a
paused schedule on a config change, moves the cursor to now (the new
definition fires after now) and keeps the origin of intervals (set once, when
the schedule is first seen); with ARGV[9] both move to that instant instead.

Returns {code, version, id1, ..., idN}: OK (written) or UNCHANGED (or {'!moved'}); ids = the
occurrences created under the old definition, for the caller to cancel.
]]
-- @include "common"

local _, moved = placed(ARGV[8] or '', KEYS[1])
if moved then return {'!moved'} end
local now = now_ms(ARGV[1])
local h = KEYS[1]
local source, chash = ARGV[4], ARGV[5]
if source == 'config' then
  local stored = redis.call('HMGET', h, 'chash', 'csince', 'ver')
  if stored[1] == chash or tonumber(stored[2] or '0') > tonumber(ARGV[6]) then
    return {UNCHANGED, tonumber(stored[3] or '0')}
  end
end
if redis.call('HEXISTS', h, 'def') == 0 then  -- new, or over a removal's tombstone
  redis.call('DEL', h)
  redis.call('HSET', h, 'epoch', ARGV[7], 'origin', now)
end
local ver = redis.call('HINCRBY', h, 'ver', 1)
local after = ARGV[9] or ''
local last = now
if after ~= '' then
  last = after
  redis.call('HSET', h, 'origin', after)
end
redis.call('HSET', h, 'name', ARGV[2], 'def', ARGV[3], 'src', source, 'last', last, 'updated', now)
if (ARGV[10] or '') == '1' then redis.call('HSET', h, 'paused', '1') end
if source == 'config' then redis.call('HSET', h, 'chash', chash, 'csince', ARGV[6], 'paused', '0') end
redis.call('SADD', KEYS[2], ARGV[2])
local out = {OK, ver}
for _, id in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do out[#out + 1] = id end
redis.call('DEL', KEYS[3])
return out

--[[ drop_schedule: remove a recurring schedule (one shard).

KEYS[1]  schedule hash     {p}:{s}:sched:<name>
KEYS[2]  shard's names     {p}:{s}:scheds
KEYS[3]  occurrences       {p}:{s}:occ:<name>
ARGV[1]  now, epoch ms ('' = the Redis server's TIME; unused)
ARGV[2]  name
ARGV[3]  'config': only a schedule that came from the config (it has a config
         hash) is removed (a config entry was deleted), and only when no
         scheduler started later than ARGV[4] wrote it; '' any schedule
ARGV[4]  config: when the removing scheduler started, epoch ms
ARGV[5]  how long a config removal's tombstone stays, ms: the schedule's hash
         keeps only csince (an older scheduler's config does not bring it back)

Returns {code, id1, ..., idN}: OK, UNCHANGED (kept: it was added at run time)
or NOT_FOUND; ids = its occurrences, for the caller to cancel; {'!moved'} while a
reshard moves it (for milliseconds: the caller asks again).
]]
-- @include "common"

if redis.call('HEXISTS', KEYS[1], 'mv') == 1 then return {'!moved'} end  -- a reshard is moving it: ask again
if redis.call('HEXISTS', KEYS[1], 'def') == 0 then  -- none, or a tombstone
  redis.call('SREM', KEYS[2], ARGV[2])
  return {NOT_FOUND}
end
if ARGV[3] == 'config' then
  local stored = redis.call('HMGET', KEYS[1], 'chash', 'csince')
  if not stored[1] or tonumber(stored[2] or '0') > tonumber(ARGV[4]) then return {UNCHANGED} end
end
local out = {OK}
for _, id in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do out[#out + 1] = id end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('SREM', KEYS[2], ARGV[2])
if ARGV[3] == 'config' then
  redis.call('HSET', KEYS[1], 'csince', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
return out

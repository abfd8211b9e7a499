--[[ drop_schedule: remove a recurring schedule (one shard).

KEYS[1]  schedule hash     {p}:{s}:sched:<name>
KEYS[2]  shard's names     {p}:{s}:scheds
KEYS[3]  occurrences       {p}:{s}:occ:<name>
ARGV[1]  now, epoch ms ('' = the Redis server's TIME; unused)
ARGV[2]  name
ARGV[3]  'config': only a schedule that came from the config (it has a config
         hash) is removed (a config entry was deleted); '' any schedule

Returns {code, id1, ..., idN}: OK, UNCHANGED (kept: it was added at run time)
or NOT_FOUND; ids = its occurrences, for the caller to cancel.
]]
-- @include "common"

if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[2], ARGV[2])
  return {NOT_FOUND}
end
if ARGV[3] == 'config' and not redis.call('HGET', KEYS[1], 'chash') then return {UNCHANGED} end
local out = {OK}
for _, id in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do out[#out + 1] = id end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('SREM', KEYS[2], ARGV[2])
return out

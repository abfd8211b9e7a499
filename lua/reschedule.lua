--[[ reschedule: move a still-scheduled job to a new due time.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  job record        {p}:{s}:job:<id>
ARGV[1]  job id
ARGV[2]  new due time: '<ms>' epoch ms, or '+<ms>' a delay from now
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number
ARGV[6]  now, epoch ms ('' = the Redis server's TIME)

Returns {code, state, due}: 1 moved (due = the new due time, ms); 0 no such job; -1 not SCHEDULED any more
(state says what it is), nothing changed.
]]
-- @include "common"

local st, due = unpack(redis.call('HMGET', KEYS[4], 'st', 'due'))
if not st then return {0, ''} end
if st ~= 'SCHEDULED' then return {-1, st} end
local spec, bucket_ms = ARGV[2], tonumber(ARGV[3])
local new_due = due_from(spec, now_ms(ARGV[6]))
due_rem(KEYS[1], KEYS[2], ARGV[1], tonumber(due), bucket_ms)
due_add(KEYS[1], KEYS[2], ARGV[1], new_due, bucket_ms)
redis.call('HSET', KEYS[4], 'due', new_due)
maybe_wake(KEYS[3], ARGV[4], ARGV[5], new_due)
return {1, st, new_due}

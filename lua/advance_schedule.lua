--[[ advance_schedule: record the occurrences a scheduler created and move the cursor (one shard).

Run by the scheduler holding the shard's lease, after it stored the
occurrences (ordinary delayed jobs whose ids derive from the schedule's
name, version and fire time, so storing one twice is a no-op). The cursor
only moves from the value the scheduler read, at the version it read: a
definition changed, paused or removed meanwhile makes this a no-op (the
caller cancels what it created), and two schedulers can never both move it.

KEYS[1]  schedule hash     {p}:{s}:sched:<name>
KEYS[2]  occurrences       {p}:{s}:occ:<name>
KEYS[3]  shard lease       {p}:{s}:lease
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  lease owner token ('' = no lease check)
ARGV[3]  lease fence
ARGV[4]  version read
ARGV[5]  cursor read (the last fire time covered, ms)
ARGV[6]  new cursor, ms
ARGV[7]  most occurrences kept in KEYS[2] (the newest)
ARGV[8..] occurrence id, fire time (ms), ...

Returns {code}: OK, NOT_OWNER (lease not held, or a reshard is moving the
schedule) or WRONG_STATE (the schedule
changed or went away since it was read).
]]
-- @include "common"

if not lease_ok(KEYS[3], ARGV[2], ARGV[3]) then return {NOT_OWNER} end
local r = redis.call('HMGET', KEYS[1], 'ver', 'last', 'paused', 'mv')
if r[4] then return {NOT_OWNER} end  -- a reshard is moving it to another shard: its new holder goes on
if r[1] ~= ARGV[4] or r[2] ~= ARGV[5] or r[3] == '1' then return {WRONG_STATE} end
for i = 8, #ARGV, 2 do redis.call('ZADD', KEYS[2], ARGV[i + 1], ARGV[i]) end
local keep = tonumber(ARGV[7])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -keep - 1)
redis.call('HSET', KEYS[1], 'last', ARGV[6])
return {OK}

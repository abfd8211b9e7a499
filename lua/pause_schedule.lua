--[[ pause_schedule: pause or resume a recurring schedule (one shard).

KEYS[1]  schedule hash     {p}:{s}:sched:<name>
KEYS[2]  occurrences       {p}:{s}:occ:<name>
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  '1' pause, '0' resume

A pause returns the pending occurrences for the caller to cancel; a resume
bumps the version and moves the cursor to now: what fell due while paused is
not run.

Returns {code, id1, ..., idN}: OK, UNCHANGED (already so) or NOT_FOUND.
]]
-- @include "common"

if redis.call('EXISTS', KEYS[1]) == 0 then return {NOT_FOUND} end
if redis.call('HEXISTS', KEYS[1], 'mv') == 1 then return {'!moved'} end  -- a reshard is moving it: ask again
local want = ARGV[2]
if (redis.call('HGET', KEYS[1], 'paused') or '0') == want then return {UNCHANGED} end
local now = now_ms(ARGV[1])
redis.call('HINCRBY', KEYS[1], 'ver', 1)
redis.call('HSET', KEYS[1], 'paused', want, 'last', now, 'updated', now)
local out = {OK}
for _, id in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do out[#out + 1] = id end
redis.call('DEL', KEYS[2])
return out

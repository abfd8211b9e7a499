--[[ lease: take, keep or give up a named lease (one holder at a time).

KEYS[1]  the lease key (a STRING "<owner>|<fence>")
KEYS[2]  its fence counter (INCR on every new holder)
ARGV[1]  now, epoch ms (unused: Redis expires the key; kept for the convention)
ARGV[2]  owner token
ARGV[3]  lease, ms ('0' = give it up)

Returns {code, fence}: OK and the fence when the caller holds the lease now
(taken, or kept: the deadline moves on); NOT_OWNER and '' when another owner
holds it.
]]
-- @flags allow-oom
-- @include "common"

local cur = redis.call('GET', KEYS[1])
local owner, ms = ARGV[2], tonumber(ARGV[3])
if cur and string.sub(cur, 1, #owner + 1) ~= owner .. '|' then return {NOT_OWNER, ''} end
if ms == 0 then
  if cur then redis.call('DEL', KEYS[1]) end
  return {OK, ''}
end
local fence
if cur then
  fence = string.sub(cur, #owner + 2)
else
  fence = tostring(redis.call('INCR', KEYS[2]))
end
redis.call('SET', KEYS[1], owner .. '|' .. fence, 'PX', ms)
return {OK, fence}

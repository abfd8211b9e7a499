--[[ requeue: schedule dead letters of one shard again, attempt counter reset.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  dead letters      {p}:{s}:dlq
ARGV[1]  job key prefix    {p}:{s}:job:
ARGV[2]  due: '<ms>' epoch ms, or '+<ms>' a delay added to now
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number
ARGV[6]  now, epoch ms ('' = the Redis server's TIME)
ARGV[7..] job ids

Each DEAD job gets st=SCHEDULED, the due time, retries=0 (its stored message
was built with retries 0), and leaves the dead-letter set; its failure
history is cleared and `requeued` counts the requeues.

Returns {due ms, code per id, in order}: 1 requeued; 0 no such record (its
index entry is dropped); -1 not DEAD (its index entry is dropped, the record is
left alone); -2 DEAD but without a message to send (left in the dead-letter queue).
]]
-- @include "common"

local prefix, bucket_ms = ARGV[1], tonumber(ARGV[3])
local now = now_ms(ARGV[6])
local due = due_from(ARGV[2], now)
local out, any = {due}, false
for i = 7, #ARGV do
  local id = ARGV[i]
  local jk = prefix .. id
  local st = redis.call('HGET', jk, 'st')
  if not st then
    redis.call('ZREM', KEYS[4], id)
    out[#out + 1] = 0
  elseif st ~= 'DEAD' then
    redis.call('ZREM', KEYS[4], id)
    out[#out + 1] = -1
  elseif redis.call('HEXISTS', jk, 'msg') == 0 then
    out[#out + 1] = -2
  else
    redis.call('ZREM', KEYS[4], id)
    redis.call('HDEL', jk, 'died', 'first_at', 'last_at', 'etype', 'emsg', 'tb', 'host', 'attempts',
      'delay', 'released', 'finished', 'reason', 'att', 'started', 'wk')
    redis.call('HSET', jk, 'st', 'SCHEDULED', 'due', due, 'retries', 0, 'requeued_at', now)
    redis.call('HINCRBY', jk, 'requeued', 1)
    due_add(KEYS[1], KEYS[2], id, due, bucket_ms)
    any = true
    out[#out + 1] = 1
  end
end
if any then maybe_wake(KEYS[3], ARGV[4], ARGV[5], due) end
return out

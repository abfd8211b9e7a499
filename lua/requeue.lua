--[[ requeue: schedule dead letters of one shard again, attempt counter reset.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  dead letters      {p}:{s}:dlq
KEYS[5]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  due: '<ms>' epoch ms, or '+<ms>' a delay added to now
ARGV[4]  bucket width, ms (0 = one due set)
ARGV[5]  wake channel      {p}:wake
ARGV[6]  shard number
ARGV[7]  '1' to append to the change log (a database mirrors the store), '' not
ARGV[8..] job ids

Each DEAD job gets st=SCHEDULED, the due time, retries=0 (its stored message
was built with retries 0), and leaves the dead-letter set; its failure
history is cleared and `requeued` counts the requeues; its message's
delayed_eta header (the task's request.eta) gets the new due time.

Returns {due ms, then per id, in order: code, state}:
  OK           requeued
  NOT_FOUND    no such record (its index entry is dropped)
  WRONG_STATE  not DEAD (its index entry is dropped, the record is left alone)
  NO_MESSAGE   DEAD but without a message to send (left in the dead-letter queue)
]]
-- @include "common"
-- @include "due_index"
-- @include "changes"
-- @include "eta"
-- @include "ops"
-- @include "shaping"

local now = now_ms(ARGV[1])
local prefix, bucket_ms = ARGV[2], tonumber(ARGV[4])
local due = due_from(ARGV[3], now)
local out, requeued = {due}, {}
local base = shard_base(KEYS[1])
for i = 8, #ARGV do
  local id = ARGV[i]
  local jk = prefix .. id
  local st = redis.call('HGET', jk, 'st')
  local code = OK
  if not st then
    redis.call('ZREM', KEYS[4], id)
    code = NOT_FOUND
  elseif st ~= 'DEAD' then
    redis.call('ZREM', KEYS[4], id)
    code = WRONG_STATE
  elseif redis.call('HEXISTS', jk, 'msg') == 0 then
    code = NO_MESSAGE
  else
    redis.call('HSET', jk, 'msg', with_eta(redis.call('HGET', jk, 'msg'), due))
    redis.call('ZREM', KEYS[4], id)
    redis.call('HDEL', jk, 'died', 'first_at', 'last_at', 'etype', 'emsg', 'tb', 'host', 'attempts',
      'delay', 'released', 'finished', 'reason', 'att', 'started', 'wk')
    redis.call('HSET', jk, 'st', 'SCHEDULED', 'due', due, 'retries', 0, 'requeued_at', now)
    redis.call('HINCRBY', jk, 'requeued', 1)
    due_add_job(KEYS[1], KEYS[2], jk, id, due, bucket_ms)
    local task, q = unpack(redis.call('HMGET', jk, 'task', 'q'))
    ix_add(base, task, q, id, due)
    requeued[#requeued + 1] = id
  end
  out[#out + 1] = code
  out[#out + 1] = st or ''
end
stats_add(base, 'requeued', #requeued)
if #requeued > 0 then maybe_wake(KEYS[3], ARGV[5], ARGV[6], due) end
log_change(KEYS[5], ARGV[7], 'SCHEDULED', requeued)
return out

--[[ refuse_claimed: put back claimed jobs the broker refused (publish path).

A message the broker refuses would be refused again: instead of waiting out
its claim lease with its batch, the job goes back to the due set at once, a
little later each time (base * 2^(n-1), capped). A refusal that says the
message can never be taken (no such exchange, over the broker's size limit)
counts: after `max` of them the job is dead-lettered with the broker's
reason. A nack (the broker could not take it now, e.g. a full queue with
reject-publish) puts it back without counting.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  in-flight set     {p}:{s}:inflight
KEYS[5]  dead-letter set   {p}:{s}:dlq
KEYS[6]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number
ARGV[6]  refusals before the job is dead-lettered
ARGV[7]  delay after the first refusal, ms (doubled after each)
ARGV[8]  longest delay, ms
ARGV[9]  dead letters' max age, ms
ARGV[10] most dead letters this shard keeps
ARGV[11] '1' to append to the change log (a database mirrors the store), '' not
ARGV[12..] triples: job id, the broker's reason, '1' when the refusal counts
           toward `max` ('' for a nack)

Returns {OK, then per job: id, state, counted refusals}: state SCHEDULED (put back),
DEAD (dead-lettered), or the state it had when it was no longer CLAIMED in
flight ('' for none: acknowledged or cancelled meanwhile; left alone).

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"
-- @include "due_index"
-- @include "dlq"
-- @include "changes"
-- @include "ops"
-- @include "shaping"
-- @include "eta"
-- @include "compact"

local now = now_ms(ARGV[1])
local prefix, bucket_ms = ARGV[2], tonumber(ARGV[3])
local max, base, cap = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local out, dead, earliest_back = {OK}, 0, nil
local back_ids, dead_ids = {}, {}
for i = 12, #ARGV, 3 do
  local id, why, counts = ARGV[i], ARGV[i + 1], ARGV[i + 2] == '1'
  local jk = prefix .. id
  local st = redis.call('HGET', jk, 'st')
  local n = 0
  if st == 'CLAIMED' and redis.call('ZREM', KEYS[4], id) == 1 then
    local reason
    if counts then
      n = redis.call('HINCRBY', jk, 'refused', 1)
      reason = 'refused by the broker (' .. n .. ' of ' .. max .. '): ' .. why
    else
      n = tonumber(redis.call('HGET', jk, 'refused') or 0)
      reason = why
    end
    if counts and n >= max then
      local m = message_of(shard_base(KEYS[1]), jk, id, redis.call('HGET', jk, 'tg') or '0')
      if m then redis.call('HSET', jk, 'msg', m) end  -- a dead letter keeps its message (a compact one, rendered)
      redis.call('HSET', jk, 'st', 'DEAD', 'died', now, 'reason', reason, 'etype', 'Unpublishable', 'emsg', reason)
      redis.call('ZADD', KEYS[5], now, id)
      st, dead = 'DEAD', dead + 1
      dead_ids[#dead_ids + 1] = id
      stats_add(shard_base(KEYS[1]), 'dead', 1)
    else
      local tries = redis.call('HINCRBY', jk, 'claims', 0)  -- back off by how often it was claimed
      local due = now + math.min(cap, base * 2 ^ math.max(0, tries - 1))
      redis.call('HSET', jk, 'st', 'SCHEDULED', 'due', due, 'reason', reason)
      due_add_job(KEYS[1], KEYS[2], jk, id, due, bucket_ms)
      local task, q = unpack(redis.call('HMGET', jk, 'task', 'q'))
      ix_add(shard_base(KEYS[1]), task, q, id, due)
      if (not earliest_back) or due < earliest_back then earliest_back = due end
      st = 'SCHEDULED'
      back_ids[#back_ids + 1] = id
    end
  end
  out[#out + 1] = id
  out[#out + 1] = st or ''
  out[#out + 1] = n
end
if earliest_back then maybe_wake(KEYS[3], ARGV[4], ARGV[5], earliest_back) end
if dead > 0 then dlq_trim(KEYS[5], prefix, now - tonumber(ARGV[9]), tonumber(ARGV[10]), 1000) end
log_change(KEYS[6], ARGV[11], 'SCHEDULED', back_ids)
log_change(KEYS[6], ARGV[11], 'DEAD', dead_ids)
return out

--[[ reschedule: move a still-scheduled job to a new due time.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  job record        {p}:{s}:job:<id>
KEYS[5]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job id
ARGV[3]  new due time: '<ms>' epoch ms, or '+<ms>' a delay from now
ARGV[4]  bucket width, ms (0 = one due set)
ARGV[5]  wake channel      {p}:wake
ARGV[6]  shard number
ARGV[7]  '1' to append to the change log (a database mirrors the store), '' not
ARGV[8]  how long, ms, a compact job's template must outlive its due time (the record ttl)

The message's delayed_eta header (what the task sees as request.eta) gets the new due time.

Returns {code, state, due}:
  OK           moved; due = the new due time, epoch ms
  NOT_FOUND    no such job
  WRONG_STATE  not SCHEDULED any more (state says what it is); nothing changed
Its pending-index entry moves with it; a job a pause held back goes back to
the due set (released, or held again, when due).
]]
-- @include "common"
-- @include "due_index"
-- @include "changes"
-- @include "eta"
-- @include "ops"
-- @include "shaping"
-- @include "compact"

local jk, id = KEYS[4], ARGV[2]
local st, due, task, q, tp = unpack(redis.call('HMGET', jk, 'st', 'due', 'task', 'q', 'tp'))
if not st then return {NOT_FOUND, '', 0} end
if st ~= 'SCHEDULED' then return {WRONG_STATE, st, 0} end
local bucket_ms = tonumber(ARGV[4])
local new_due = due_from(ARGV[3], now_ms(ARGV[1]))
due_rem(KEYS[1], KEYS[2], id, tonumber(due), bucket_ms)
due_add_job(KEYS[1], KEYS[2], jk, id, new_due, bucket_ms)
redis.call('HSET', jk, 'due', new_due)
local base = shard_base(jk)
local msg = redis.call('HGET', jk, 'msg')
if msg then
  redis.call('HSET', jk, 'msg', with_eta(msg, new_due))
elseif tp then  -- compact: its delayed_eta field, and a template that lives as long as the job needs it
  redis.call('HSET', jk, 'e', '"' .. iso_utc(new_due) .. '"')
  local tk, want = base .. 'tpl:' .. tp, new_due - now_ms(ARGV[1]) + (tonumber(ARGV[8]) or 0)
  keep_template(tk, want)
end
task, q = route_of(base, task, q, tp)
ix_add(base, task, q, id, new_due)
redis.call('ZREM', base .. 'held', id)
limit_unpark(base, jk, id)
maybe_wake(KEYS[3], ARGV[5], ARGV[6], new_due)
log_change(KEYS[5], ARGV[7], 'SCHEDULED', {id})
return {OK, st, new_due}

--[[ move_out: take jobs out of a shard a reshard moves them from (one shard).

`delayed reshard` moves each job whose home under the new shard count is
another shard in three steps, each atomic on one shard (so it works on Redis
Cluster): move_out here, move_in on the new shard, then the old record is
deleted. A taken job is MOVING (its state kept in `mvst`) and in the shard's
`moving` set, so a reshard that stopped half-way finds it again; nothing
releases, cancels or changes it meanwhile (an operation on it is tried again).

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  dead letters      {p}:{s}:dlq
KEYS[4]  held (paused)     {p}:{s}:held
KEYS[5]  being moved       {p}:{s}:moving   SET of ids
ARGV[1]  now, epoch ms ('' = the Redis server's TIME; unused)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms
ARGV[4..] per job: id, task, queue (its pending index; a compact record's come from its template)

Moves SCHEDULED jobs (out of the due set, the held set and the pending index)
and finished ones (done markers and dead letters, out of the dead-letter
set: the time it died is kept in `mvdlq`). Leaves a job that is released
or running (its worker finds it by its message's shard header: it moves when
it is done) and one that is gone.

Returns per job {id, pttl, fields} (fields: HGETALL, st = MOVING) when taken
(again, for one taken before), or {id, -3, state} when left where it is.
]]
-- @include "common"
-- @include "due_index"
-- @include "ops"
-- @include "shaping"

local call = redis.call
local prefix, bucket_ms = ARGV[2], tonumber(ARGV[3])
local base = shard_base(KEYS[1])
local MOVABLE = {SCHEDULED = true, SUCCEEDED = true, FAILED = true, DEAD = true, CANCELLED = true,
                 EXPIRED = true, SKIPPED = true}
local out = {}
for i = 4, #ARGV, 3 do
  local id, task, q = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local jk = prefix .. id
  local st = call('HGET', jk, 'st')
  if st == 'MOVING' or (st and MOVABLE[st]) then
    if st ~= 'MOVING' then
      if st == 'SCHEDULED' then
        local due = tonumber(call('HGET', jk, 'due'))
        if due_rem(KEYS[1], KEYS[2], id, due, bucket_ms) == 0 then call('ZREM', KEYS[4], id) end
        shaping_forget(base, jk, id)
        ix_rem(base, task, q, id)
      elseif st == 'DEAD' then
        local died = call('ZSCORE', KEYS[3], id)
        if died then
          call('HSET', jk, 'mvdlq', died)
          call('ZREM', KEYS[3], id)
        end
      end
      call('HSET', jk, 'st', 'MOVING', 'mvst', st)
      call('SADD', KEYS[5], id)
    end
    out[#out + 1] = {id, call('PTTL', jk), call('HGETALL', jk)}
  else
    out[#out + 1] = {id, -3, st or ''}
  end
end
return out

--[[ move_in: store jobs a reshard moves into their new shard (one shard).

The second step of a move (see move_out.lua): the record is written as it
was (its state back from `mvst`), with the time it had left to live; a
SCHEDULED job is indexed by due time and in the pending index, a dead letter
in the dead-letter set. A job whose id this shard holds already is left as
it is (a move that stopped after this step and is done again).

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  dead letters      {p}:{s}:dlq
ARGV[1]  now, epoch ms ('' = the Redis server's TIME; unused)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number
ARGV[6..] per job: id, pttl (ms, -1: none), task, queue, N, then N pairs field, value
          (the record without `mvst`/`mvdlq`; st its state; '~dlq' the time it died, not stored)

Returns the number of jobs written.
]]
-- @include "common"
-- @include "due_index"
-- @include "ops"
-- @include "shaping"

local call = redis.call
local prefix, bucket_ms, channel, shard = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local base = shard_base(KEYS[1])
local i, n, written, earliest = 6, #ARGV, 0, nil
while i <= n do
  local id, pttl, task, q, nf = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  local jk = prefix .. id
  if call('EXISTS', jk) == 0 then
    local rec, st, due, died = {}, nil, nil, nil
    for j = i + 5, i + 4 + 2 * nf, 2 do
      local name, v = ARGV[j], ARGV[j + 1]
      if name == '~dlq' then died = v
      else
        rec[#rec + 1] = name; rec[#rec + 1] = v
        if name == 'st' then st = v elseif name == 'due' then due = tonumber(v) end
      end
    end
    call('HSET', jk, unpack(rec))
    if pttl > 0 then call('PEXPIRE', jk, pttl) end
    if st == 'SCHEDULED' and due then
      due_add_job(KEYS[1], KEYS[2], jk, id, due, bucket_ms)
      ix_add(base, task, q, id, due)
      if (not earliest) or due < earliest then earliest = due end
    elseif st == 'DEAD' and died then
      call('ZADD', KEYS[4], died, id)
    end
    written = written + 1
  end
  i = i + 5 + 2 * nf
end
if earliest then maybe_wake(KEYS[3], channel, shard, earliest) end
return written

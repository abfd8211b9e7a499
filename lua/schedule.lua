--[[ schedule: store new jobs of one shard and index them by due time.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number
ARGV[6]  C, the number of record fields shared by every job of this call
ARGV[7 .. 6+2C]  C pairs: field name, value
ARGV[7+2C]  F, the number of record fields each job carries itself
then F field names; then per job: id, due, F field values (an empty value is
  not stored). due is '<ms>', an epoch time (may be in the past: released at
  once), or '+<ms>', a delay added to now (the Redis server's clock).
  (Shared fields are sent once per call: every argument becomes a Lua string,
  and that, more than the writes, is what a large batch costs.)

The record gets st=SCHEDULED, due, created (now), the shared and its own fields;
an `exp` given as '+<ms>' (Celery's relative `expires`) becomes now + ms.
A job whose id is taken is not written, except that a job with a `gen` field
(a later generation of an idempotency key's job) replaces a CANCELLED record
of the generation before it: a cancel frees the key, and the worker side
refuses the old generation's messages (start.lua compares `gen`).
Each stored job is also indexed by task and queue, and counted (`scheduled`)
in the shard's stats (includes/ops.lua).
Returns one entry per job, in order: '=<due ms>' when stored;
'<state>|<due>|<gen>' of the record already held under that id.
]]
-- @include "common"
-- @include "due_index"
-- @include "ops"

local call = redis.call
local NONE = {false}
local now = now_ms(ARGV[1])
local prefix, bucket_ms = ARGV[2], tonumber(ARGV[3])
local channel, shard = ARGV[4], ARGV[5]
local rec = {'st', 'SCHEDULED', 'due', 0, 'created', now}
local at = 7 + 2 * tonumber(ARGV[6])
-- A relative `exp` ('+<ms>') counts from this server's clock, as `due` does.
local function field_value(name, v)
  if name == 'exp' and string.byte(v, 1) == 43 then return now + tonumber(string.sub(v, 2)) end
  return v
end
for j = 7, at - 1, 2 do rec[#rec + 1] = ARGV[j]; rec[#rec + 1] = field_value(ARGV[j], ARGV[j + 1]) end
local base, nf = #rec, tonumber(ARGV[at])
local names, gen_at, exp_at = {}, nil, nil
local task_at, q_at, task0, q0 = nil, nil, nil, nil  -- the pending index: own fields, or shared ones
for j = 7, at - 2, 2 do
  if ARGV[j] == 'task' then task0 = ARGV[j + 1] elseif ARGV[j] == 'q' then q0 = ARGV[j + 1] end
end
for f = 1, nf do
  names[f] = ARGV[at + f]
  if names[f] == 'gen' then gen_at = f elseif names[f] == 'exp' then exp_at = f
  elseif names[f] == 'task' then task_at = f elseif names[f] == 'q' then q_at = f end
end
local ix, stored = {}, 0

local out, n, i, earliest_new, zs = {}, #ARGV, at + nf + 1, nil, {}
while i <= n do
  local id, spec = ARGV[i], ARGV[i + 1]
  local due  -- due_from, inlined: this loop runs once per job of a large batch
  if string.byte(spec, 1) == 43 then due = now + tonumber(string.sub(spec, 2)) else due = tonumber(spec) end
  local jk = prefix .. id
  local held = NONE  -- EXISTS first: an integer reply is cheaper than HMGET's table of nils
  if call('EXISTS', jk) == 1 then held = call('HMGET', jk, 'st', 'due', 'gen') end
  if held[1] and gen_at and held[1] == 'CANCELLED'
      and tonumber(ARGV[i + 1 + gen_at]) == (tonumber(held[3]) or 0) + 1 then
    call('DEL', jk)  -- the next generation replaces the cancelled one
    held = NONE
  end
  if held[1] then
    out[#out + 1] = held[1] .. '|' .. (held[2] or '') .. '|' .. (held[3] or '0')
  else
    rec[4] = due
    local m = base
    for f = 1, nf do
      local v = ARGV[i + 1 + f]
      if f == exp_at and v ~= '' then v = field_value('exp', v) end
      if v ~= '' then rec[m + 1] = names[f]; rec[m + 2] = v; m = m + 2 end
    end
    call('HSET', jk, unpack(rec, 1, m))
    if bucket_ms > 0 then
      due_add(KEYS[1], KEYS[2], id, due, bucket_ms)
    else  -- one ZADD per 256 jobs: a call from Lua costs more than a member
      zs[#zs + 1] = due; zs[#zs + 1] = id
      if #zs >= 512 then call('ZADD', KEYS[1], unpack(zs)); zs = {} end
    end
    if (not earliest_new) or due < earliest_new then earliest_new = due end
    ix_push(ix, task_at and ARGV[i + 1 + task_at] or task0, q_at and ARGV[i + 1 + q_at] or q0, due, id)
    stored = stored + 1
    out[#out + 1] = '=' .. due
  end
  i = i + 2 + nf
end
if #zs > 0 then call('ZADD', KEYS[1], unpack(zs)) end
if stored > 0 then
  local base = shard_base(KEYS[1])
  ix_flush(base, ix, 'add')
  stats_add(base, 'scheduled', stored)
end
if earliest_new then maybe_wake(KEYS[3], channel, shard, earliest_new) end
return out

--[[ schedule: store new jobs of one shard and index them by due time.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  (compact jobs only) their template {p}:{s}:tpl:<tp>
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number, '<shard>/<count>': the shard count it was placed with
         (refused, {'!moved'}, when a reshard sealed the shard against that count)
ARGV[6]  C, the number of record fields shared by every job of this call
ARGV[7 .. 6+2C]  C pairs: field name, value
ARGV[7+2C]  F, the number of record fields each job carries itself
then F field names; then per job: id, due, F field values (an empty value is
  not stored). due is '<ms>', an epoch time (may be in the past: released at
  once), or '+<ms>', a delay added to now (the Redis server's clock).
  (Shared fields are sent once per call: every argument becomes a Lua string,
  and that, more than the writes, is what a large batch costs.)
  Shared pairs whose name starts with '~' are not stored: '~task' and '~q'
  name the task and queue of compact jobs (for the pending index), '~tpl' is
  their template's JSON (stored at KEYS[4]), '~keep' how long, ms, the
  template must outlive the latest due time of the call (a released job's
  record may need it again until it expires).

The record gets st=SCHEDULED, due, created (now), the shared and its own fields;
an `exp` given as '+<ms>' (Celery's relative `expires`) becomes now + ms.
A job whose id is taken is not written, except that a job with a `gen` field
(a later generation of an idempotency key's job) replaces a CANCELLED record
of the generation before it: a cancel frees the key, and the worker side
refuses the old generation's messages (start.lua compares `gen`).
Each stored job is also indexed by task and queue, and counted (`scheduled`)
in the shard's stats (includes/ops.lua); a job with a tenant (`tn`) enters
its tenant's lane (includes/shaping.lua).
Returns one entry per job, in order: '=<due ms>' when stored;
'<state>|<due>|<gen>' of the record already held under that id; or {'!tpl'}
when KEYS[4] is given, does not exist and no '~tpl' came with the call
(nothing is written: call again with it); {'!moved'} (nothing written) when the
shard was sealed against the caller's shard count.

Compact jobs (store/compact.py) keep their template alive: its TTL is pushed
to at least the latest due time of the call plus '~keep' (with an eighth more:
keep_template in includes/common.lua).
]]
-- @include "common"
-- @include "due_index"
-- @include "ops"
-- @include "shaping"

local call = redis.call
local NONE = {false}
local now = now_ms(ARGV[1])
local prefix, bucket_ms = ARGV[2], tonumber(ARGV[3])
local channel = ARGV[4]
local sbase = shard_base(KEYS[1])
local shard, moved = placed(ARGV[5], KEYS[1])
if moved then return {'!moved'} end
local rec = {'st', 'SCHEDULED', 'due', 0, 'created', now}
local at = 7 + 2 * tonumber(ARGV[6])
-- A relative `exp` ('+<ms>') counts from this server's clock, as `due` does.
local function field_value(name, v)
  if name == 'exp' and string.byte(v, 1) == 43 then return now + tonumber(string.sub(v, 2)) end
  return v
end
local task0, q0, tn0, tpl, keep = nil, nil, nil, nil, 0  -- the pending index: shared fields or hints; a template
for j = 7, at - 1, 2 do
  local name, v = ARGV[j], ARGV[j + 1]
  if string.byte(name, 1) == 126 then  -- '~': a hint, not a field
    if name == '~task' then task0 = v elseif name == '~q' then q0 = v
    elseif name == '~tpl' then tpl = v elseif name == '~keep' then keep = tonumber(v) end
  else
    rec[#rec + 1] = name; rec[#rec + 1] = field_value(name, v)
    if name == 'task' then task0 = v elseif name == 'q' then q0 = v elseif name == 'tn' then tn0 = v end
  end
end
if KEYS[4] then
  if tpl then call('SET', KEYS[4], tpl, 'KEEPTTL') elseif call('EXISTS', KEYS[4]) == 0 then return {'!tpl'} end
end
local base, nf = #rec, tonumber(ARGV[at])
local names, gen_at, exp_at = {}, nil, nil
local task_at, q_at, tn_at = nil, nil, nil
for f = 1, nf do
  names[f] = ARGV[at + f]
  if names[f] == 'gen' then gen_at = f elseif names[f] == 'exp' then exp_at = f
  elseif names[f] == 'task' then task_at = f elseif names[f] == 'q' then q_at = f
  elseif names[f] == 'tn' then tn_at = f end
end
local ix, stored = {}, 0

local out, n, i, earliest_new, zs, latest = {}, #ARGV, at + nf + 1, nil, {}, nil
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
    if (not latest) or due > latest then latest = due end
    ix_push(ix, task_at and ARGV[i + 1 + task_at] or task0, q_at and ARGV[i + 1 + q_at] or q0, due, id)
    if tn_at or tn0 then tenant_add(sbase, tn_at and ARGV[i + 1 + tn_at] or tn0, id, due) end
    stored = stored + 1
    out[#out + 1] = '=' .. due
  end
  i = i + 2 + nf
end
if #zs > 0 then call('ZADD', KEYS[1], unpack(zs)) end
if KEYS[4] and latest then  -- the template outlives every job that needs it
  local want = latest - now + keep
  keep_template(KEYS[4], want)
end
if stored > 0 then
  local base = shard_base(KEYS[1])
  ix_flush(base, ix, 'add')
  stats_add(base, 'scheduled', stored)
end
if earliest_new then maybe_wake(KEYS[3], channel, shard, earliest_new) end
return out

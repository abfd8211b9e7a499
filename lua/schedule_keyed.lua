--[[ schedule_keyed: store one job under a debounce or throttle key (one shard).

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  the key's entry   {p}:{s}:debounce:<key> or {p}:{s}:throttle:<key> (HASH: id, first)
KEYS[5]  (compact job only) its template {p}:{s}:tpl:<tp>
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  bucket width, ms (0 = one due set)
ARGV[4]  wake channel      {p}:wake
ARGV[5]  shard number, '<shard>/<count>' as in schedule.lua (refused: {'!moved'})
ARGV[6]  mode: 'debounce' or 'throttle'
ARGV[7]  debounce: max_wait, ms ('' = none); throttle: the window, ms
ARGV[8]  record ttl, ms (how long the entry and a template outlive the due time)
ARGV[9]  the id of a new job (used only when one is created)
ARGV[10] due: '<ms>' epoch ms, or '+<ms>' a delay added to now
ARGV[11] N, then N pairs: record field name, value. '~tpl' is the template's
         JSON (stored at KEYS[5]); an 'exp' of '+<ms>' becomes now + ms.

debounce: while the key's job is still SCHEDULED (and has not run: a retry
  waiting for its next attempt does not count), the call replaces it: the
  record gets the call's fields (arguments, options) and due time, kept no
  later than `first` (the key's first call) + max_wait; the job keeps its id.
  Otherwise (no job, or it was released, cancelled, ...) a new job is created
  and the key's `first` is now. The record is marked `dk` = '1': the release
  scripts leave it in the due index until it is due, never sending it a
  look-ahead early (it would be released while later calls should still
  replace it).
throttle: while now < `first` + the window (`first`: when the key's job was
  created), the call returns the key's job as it is; otherwise a new job is
  created and `first` is now. The entry expires a minute after its window
  (by the server's clock: only a clean-up).
A stored job's delayed_eta header is its due time.

Returns {created (1/0), id, state, due ms} of the key's job, or {'!tpl'}
when KEYS[5] is given, does not exist and no '~tpl' came (nothing written).
]]
-- @include "common"
-- @include "due_index"
-- @include "eta"
-- @include "ops"
-- @include "shaping"
-- @include "compact"

local call = redis.call
local now = now_ms(ARGV[1])
local prefix, bucket_ms, channel = ARGV[2], tonumber(ARGV[3]), ARGV[4]
local shard, moved = placed(ARGV[5], KEYS[1])
if moved then return {'!moved'} end
local mode, limit, ttl = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local entry, base = KEYS[4], shard_base(KEYS[1])

local held_id, first = unpack(call('HMGET', entry, 'id', 'first'))
local old  -- the job this call replaces: {st, due, task, q, tp, created}
if held_id then
  local st, due, task, q, tp, created, att = unpack(call('HMGET', prefix .. held_id,
    'st', 'due', 'task', 'q', 'tp', 'created', 'att'))
  if mode == 'throttle' and now < (tonumber(first) or 0) + limit then
    return {0, held_id, st or '', tonumber(due) or 0}
  end
  if mode == 'debounce' and st == 'SCHEDULED' and (tonumber(att) or 0) == 0 then
    old = {st, tonumber(due), task, q, tp, created}
  end
end

local n, pairs_at = tonumber(ARGV[11]), 12
local fields, tpl = {}, nil
for j = pairs_at, pairs_at + 2 * n - 1, 2 do
  local name, v = ARGV[j], ARGV[j + 1]
  if name == '~tpl' then tpl = v else fields[name] = v end
end
if KEYS[5] then
  if tpl then call('SET', KEYS[5], tpl, 'KEEPTTL') elseif call('EXISTS', KEYS[5]) == 0 then return {'!tpl'} end
end

local id, created_at
if old then
  id, created_at = held_id, old[6]
  first = tonumber(first) or now
else
  id, created_at, first = ARGV[9], now, now
end
local due = due_from(ARGV[10], now)
if mode == 'debounce' and limit and due > first + limit then due = first + limit end

local jk = prefix .. id
if old then  -- out of the indexes it is in; the record is written anew
  due_rem(KEYS[1], KEYS[2], id, old[2], bucket_ms)
  call('ZREM', base .. 'held', id)
  limit_unpark(base, jk, id)
  local task, q = route_of(base, old[3], old[4], old[5])
  ix_rem(base, task, q, id)
  call('DEL', jk)
end
local rec = {'st', 'SCHEDULED', 'due', due, 'created', created_at}
if mode == 'debounce' then rec[#rec + 1] = 'dk'; rec[#rec + 1] = '1' end
for name, v in pairs(fields) do
  if name == 'exp' and string.byte(v, 1) == 43 then v = now + tonumber(string.sub(v, 2)) end
  if name == 'msg' then v = with_eta(v, due) end
  rec[#rec + 1] = name; rec[#rec + 1] = v
end
if fields.tp then rec[#rec + 1] = 'e'; rec[#rec + 1] = '"' .. iso_utc(due) .. '"' end
call('HSET', jk, unpack(rec))
due_add_job(KEYS[1], KEYS[2], jk, id, due, bucket_ms)
local task, q = route_of(base, fields.task, fields.q, fields.tp)
ix_add(base, task, q, id, due)
if KEYS[5] then keep_template(KEYS[5], due - now + ttl) end

if mode == 'throttle' then
  call('HSET', entry, 'id', id, 'first', now)
  call('PEXPIRE', entry, limit + 60000)  -- the window is decided by `now` (a test clock too); this only cleans up
else
  call('HSET', entry, 'id', id, 'first', first)
  call('PEXPIRE', entry, due - now + ttl)
end
if not old then stats_add(base, 'scheduled', 1) end
maybe_wake(KEYS[3], channel, shard, due)
return {old and 0 or 1, id, 'SCHEDULED', due}

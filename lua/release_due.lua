--[[ release_due: move due jobs of one shard onto their Celery queues (direct path).

Used when the broker is Redis on the same server and database as the store.
Each due job leaves the due index and its ready-built kombu message is pushed
onto the queue's list exactly as kombu's Redis transport's _put would do it,
in this one script: a job is enqueued at most once, however many schedulers run.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  lease key         {p}:{s}:lease
KEYS[5]  dead-letter set   {p}:{s}:dlq
KEYS[6]  released set      {p}:{s}:released
KEYS[7]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  most jobs to release in this call
ARGV[4]  bucket width, ms (0 = one due set)
ARGV[5]  lease owner token ('' = no lease check)
ARGV[6]  lease fence
ARGV[7]  ttl of a released job's record, ms
ARGV[8]  kombu global_keyprefix ('' for none)
ARGV[9]  kombu's dead-letter queue for unroutable messages (transport option
         deadletter_queue; '' = none: the message is dropped, as kombu drops
         it, and the record is marked reason=UNROUTABLE)
ARGV[10] dead letters' max age, ms (misfire 'dead' trims the dead-letter set)
ARGV[11] most dead letters this shard keeps
ARGV[12] '1' to append to the change log (a database mirrors the store), '' not
ARGV[13] look-ahead, ms: jobs due up to now + this are released, those not yet
         due with Celery's `eta` set to their due time (includes/eta.lua);
         except a debounce key's job (record field `dk`): it stays in the due
         index until it is due, so that a later call can still replace it
ARGV[14] the shard count, then n, then n pairs: a rate limit's key and its
         rate per second (the app's delayed_rate_limits; includes/shaping_release.lua)

A record's routing fields: lk = the list key to LPUSH (anonymous exchange:
global_keyprefix + queue + priority suffix); or bx = the exchange's binding
set, rk = routing key, ps = priority suffix (named direct exchange: pushed
to every bound queue whose routing key matches, as kombu's DirectExchange;
none bound: kombu's dead-letter queue, ARGV[9]). A record with neither
(stored for the publish path) is pushed to global_keyprefix + q.

Returns {code, released, skipped, next_due, now, hold, fair, id1, ev1, ..., idN,
evN, then per job not sent: id, state, reason}: code OK, or NOT_OWNER when
the shard's lease is not held (nothing done); next_due = the earliest due time
left in the shard, -1 when none; hold = -1, or, when debounce jobs in the
look-ahead were put back to wait for their due time, the earliest of their
due times: the caller comes back then for them, and next_due leaves them out
(it is now when the batch was full: next_visit in includes/due_index.lua);
fair = 1 when several tenants had jobs due (the batch was shared between them:
includes/shaping_release.lua), else 0; evN = the job's stored task-sent event
fields ('' when the app sends no such events). Skipped jobs were cancelled (or
otherwise no longer SCHEDULED) and are only unindexed, or were not sent
because they expired (Celery's `expires`: state EXPIRED) or missed
max_lateness with misfire 'skip' (SKIPPED) or 'dead' (DEAD): those are listed
at the end, so the caller can report them (result backend, events).

Release shaping (includes/shaping_release.lua): with tenants' jobs due, each
due tenant gets an equal share of the batch first; a job under a rate limit
with no token left waits in that limit's wait set (still SCHEDULED and
pending, counted neither released nor skipped) and goes, in due order, when
tokens come: `hold` is then at most the time the next token comes.

Pauses (includes/ops.lua): with 'all' paused nothing is released (next_due
-1); a due job of a paused task or queue moves to the shard's held set
(still SCHEDULED, counted as skipped) until a resume. Released and unsent
jobs leave the pending index; the shard's stats count them, with the
release lateness (now - due) of each released job.

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"
-- @include "due_index"
-- @include "dlq"
-- @include "misfire"
-- @include "changes"
-- @include "destination"
-- @include "ops"
-- @include "eta"
-- @include "compact"
-- @include "shaping"
-- @include "shaping_release"

if not lease_ok(KEYS[4], ARGV[5], ARGV[6]) then return {NOT_OWNER, 0, 0, -1, 0, -1, 0} end
local now = now_ms(ARGV[1])
local prefix, limit, bucket_ms = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local ttl, gkp, dead_queue = tonumber(ARGV[7]), ARGV[8], ARGV[9]
local base = shard_base(KEYS[1])
local shard, tg = shard_no(KEYS[1]), string.format('%d', now)
local paused = pauses(base)
if paused and paused.all then return {OK, 0, 0, -1, now, -1, 0} end
local gone, late = {}, late_new()  -- leaving the pending index; release lateness
local upto = now + (tonumber(ARGV[13]) or 0)
local L, S, tgone = limits_load(base, ARGV, 14), {}, {}  -- rate limits, their buckets; tenants' lanes left
local out = {OK, 0, 0, -1, now, -1, 0}
local released, skipped, dead, parked = 0, 0, 0, 0
local hold = nil  -- the earliest due time of a debounce job put back (not yet due)
local not_sent, sent_ids, unsent_by_state = {}, {}, {}
local batches, lists = {}, {}
local rel = {}  -- released jobs not yet in the released index: due, id, ...
local function flush_released()
  if #rel > 0 then redis.call('ZADD', KEYS[6], unpack(rel)); rel = {} end
end
-- Push what is batched (before any other push, so queue order stays due order).
local function flush()
  for _, lk in ipairs(lists) do
    local q = batches[lk]
    for i = 1, #q, 1000 do redis.call('LPUSH', lk, unpack(q, i, math.min(i + 999, #q))) end
  end
  batches, lists = {}, {}
end
-- One job taken out of the due index (from = nil) or out of a limit's wait set (from = its key).
local function consider(id, from)
  local jk = prefix .. id
  -- The fields every release needs first; the rarer ones (named exchange, the
  -- publish-path fallback, due for a misfire check) only when they matter:
  -- fewer fields read per job is a measurably faster release.
  local r = redis.call('HMGET', jk, 'st', 'msg', 'lk', 'ev', 'exp', 'ml', 'mf', 'due', 'task', 'q',
    'tp', 'b', 'a', 'k', 'e', 'i', 'r', 'pa', 'dk', 'tn')
  local st, msg, lk, ev, exp, ml, mf, due, task, q = unpack(r, 1, 10)
  local tn = r[20]
  local t, lost = false, false  -- a compact record's template
  if r[11] and r[12] and not msg then
    t = template(base, r[11])
    if t then task, q, lk = t.r.task, t.r.q, t.r.lk else lost = st == 'SCHEDULED' end
  end
  if from then redis.call('HDEL', jk, 'lw') end
  local ks = st == 'SCHEDULED' and L and limit_keys(L, task, q, tn)
  if st == 'SCHEDULED' and tonumber(due) > now and (r[19] or ks) then
    -- A debounce key's job goes when it is due, not a look-ahead before: until then a
    -- later call may still replace it; a rate-limited job spends its token when it is due.
    -- Back into the due index, as it was.
    local d = tonumber(due)
    due_add(KEYS[1], KEYS[2], id, d, bucket_ms)
    tenant_add(base, tn, id, d)
    if (not hold) or d < hold then hold = d end
    return
  end
  if not from then tenant_push(tgone, tn, id) end
  local sendable = st == 'SCHEDULED' and (msg or t or lost)
  if st == 'SCHEDULED' then
    if paused and is_paused(paused, task, q) then  -- held back: stays pending, out of the due set
      redis.call('ZADD', base .. 'held', due, id)
      sendable = false
    else
      local wait = ks and not lost and limit_admit(S, base, ks, now, from)
      if wait then  -- waits for a token: stays pending, in due order behind the others waiting
        limit_park(S, base, wait, jk, id, due)
        parked = parked + 1
        return
      end
      ix_push(gone, task, q, id)
    end
  end
  local bx, rk, ps = false, false, false
  if sendable and not lk then
    if t then bx, rk, ps = t.r.bx, t.r.rk, t.r.ps else bx, rk, ps = unpack(redis.call('HMGET', jk, 'bx', 'rk', 'ps')) end
  end
  local unsent, why = nil, nil
  if lost then
    unsent, why = 'DEAD', LOST_TEMPLATE
  elseif sendable then
    unsent, why = unsendable(now, due, exp, ml, mf)
    local due_n = tonumber(due)
    local early = due_n > now
    if t then
      msg = render_job(t, id, shard, r[13], r[14], r[12], r[15], r[16], r[17], r[18], due, tg,
        early and ('"' .. iso_utc(due_n) .. '"') or nil)
    elseif early then
      msg = early_eta(msg, due_n)
    end
  end
  if unsent then
    if t then  -- it leaves the pending state: its record names its task and queue; a dead letter keeps its message
      redis.call('HSET', jk, 'task', task, 'q', q)
      if unsent == 'DEAD' then redis.call('HSET', jk, 'msg', msg) end
    end
    mark_unsent(jk, KEYS[5], id, unsent, why, now, ttl)
    not_sent[#not_sent + 1] = id; not_sent[#not_sent + 1] = unsent; not_sent[#not_sent + 1] = why
    unsent_by_state[unsent] = unsent_by_state[unsent] or {}
    table.insert(unsent_by_state[unsent], id)
    skipped = skipped + 1
    if unsent == 'DEAD' then dead = dead + 1 end
  -- A record stored without lk/bx (scheduled by an app on the publish path)
  -- goes to its queue's list: a script error here would lose the whole batch.
  elseif sendable and (lk or bx or q) then
    if lk then
      local batch = batches[lk]  -- pushed at the end, one LPUSH per list: same order, fewer calls
      if not batch then batch = {}; batches[lk] = batch; lists[#lists + 1] = lk end
      batch[#batch + 1] = msg
    else
      flush()
      local lists = dest_lists(gkp, false, bx, rk, ps, q, dead_queue)
      for _, list in ipairs(lists) do redis.call('LPUSH', list, msg) end
      if #lists == 0 then redis.call('HSET', jk, 'reason', 'UNROUTABLE') end
    end
    -- The message stays until the job starts: the reconciler sends it again if the broker loses it.
    if t then  -- its record names its task and queue from now on, and the tag its message went with
      redis.call('HSET', jk, 'st', 'QUEUED', 'released', now, 'task', task, 'q', q, 'tg', tg)
    else
      redis.call('HSET', jk, 'st', 'QUEUED', 'released', now)
    end
    redis.call('PEXPIRE', jk, ttl)
    -- the released index, one ZADD per 256 jobs (see flush_released)
    rel[#rel + 1] = due or redis.call('HGET', jk, 'due'); rel[#rel + 1] = id
    if #rel >= 512 then flush_released() end
    sent_ids[#sent_ids + 1] = id
    released = released + 1
    late_add(late, math.max(0, now - tonumber(due)))  -- released early: not late
    out[#out + 1] = id
    out[#out + 1] = ev or ''
  else
    skipped = skipped + 1
  end
end
-- Jobs a rate limit held back first (they were due before the ones in the index now).
local ready = limit_ready(S, L, base, now, limit)
for i = 1, #ready, 2 do consider(ready[i], ready[i + 1]) end
local ids, fair = take_fair(base, KEYS[1], KEYS[2], bucket_ms, upto, limit - #ready / 2)
for _, id in ipairs(ids) do consider(id, nil) end
flush()
flush_released()
ix_flush(base, gone, 'rem')
tenant_flush(base, tgone)
local expired, misfired = 0, 0
for i = 2, #not_sent, 3 do
  if not_sent[i] == 'EXPIRED' then expired = expired + 1 elseif not_sent[i] == 'SKIPPED' then misfired = misfired + 1 end
end
stats_add(base, 'released', released, 'queued', released, 'expired', expired, 'skipped', misfired, 'dead', dead)
late_save(base, 'rl', late)
if dead > 0 then
  dlq_trim(KEYS[5], prefix, now - tonumber(ARGV[10]), tonumber(ARGV[11]), 1000)
end
local e = earliest(KEYS[1], KEYS[2], bucket_ms)
set_next(KEYS[3], e)
if hold then e = next_visit(KEYS[1], KEYS[2], bucket_ms, now, upto, #ids + #ready / 2 >= limit and released + skipped + parked > 0) end
-- Jobs waiting for a token: the caller comes back when the first can go.
local lnext = limit_next(S, L, base, now)
if lnext and ((not hold) or lnext < hold) then hold = lnext end
limits_save(S, base, now)
if fair then out[7] = 1 end
out[2], out[3], out[4], out[6] = released, skipped, e or -1, hold or -1
for _, v in ipairs(not_sent) do out[#out + 1] = v end
log_change(KEYS[7], ARGV[12], 'QUEUED', sent_ids)
for state, ids in pairs(unsent_by_state) do log_change(KEYS[7], ARGV[12], state, ids) end
return out

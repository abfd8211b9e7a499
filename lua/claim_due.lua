--[[ claim_due: lease due jobs of one shard to a scheduler that publishes them
(publish path: RabbitMQ, a separate Redis, any non-direct broker).

Due jobs move from the due index to the in-flight set, scored by the claim's
deadline; the caller publishes them and then calls ack_claimed. Claims whose
deadline passed (the scheduler died between claim and ack) are claimed again
first: at-least-once, never lost.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
KEYS[4]  lease key         {p}:{s}:lease
KEYS[5]  in-flight set     {p}:{s}:inflight
KEYS[6]  dead-letter set   {p}:{s}:dlq
KEYS[7]  change log        {p}:{s}:changes
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  most jobs to claim in this call
ARGV[4]  bucket width, ms (0 = one due set)
ARGV[5]  lease owner token ('' = no lease check)
ARGV[6]  lease fence
ARGV[7]  claim lease, ms (how long the caller has to publish and ack)
ARGV[8]  ttl of an expired / skipped job's record, ms
ARGV[9]  dead letters' max age, ms (misfire 'dead': the set is trimmed)
ARGV[10] most dead letters this shard keeps
ARGV[11] '1' to append to the change log (a database mirrors the store), '' not
ARGV[12] look-ahead, ms: jobs due up to now + this are claimed, those not yet
         due with Celery's `eta` set to their due time (includes/eta.lua);
         a debounce key's job waits for its due time (as in release_due)
ARGV[13] the shard count, then n, then n pairs: a rate limit's key and its
         rate per second (the app's delayed_rate_limits; includes/shaping_release.lua)

Returns {code, claimed, skipped, next_due, now, hold, fair, then per claimed job:
id, msg, exchange, routing_key, queue, ev, then per job not sent: id, state,
reason}; code OK, or NOT_OWNER when the shard's lease is not held (nothing
done); next_due and hold as in release_due. Jobs that
expired or missed max_lateness are not claimed (see release_due: EXPIRED,
SKIPPED, DEAD) and count as skipped.

Pauses, the pending index and the stats as in release_due (the jobs count as
released when ack_claimed confirms them; the release lateness is taken here).

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"
-- @include "due_index"
-- @include "dlq"
-- @include "misfire"
-- @include "changes"
-- @include "ops"
-- @include "eta"
-- @include "compact"
-- @include "shaping"
-- @include "shaping_release"

if not lease_ok(KEYS[4], ARGV[5], ARGV[6]) then return {NOT_OWNER, 0, 0, -1, 0, -1, 0} end
local now = now_ms(ARGV[1])
local prefix, limit, bucket_ms = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local deadline = now + tonumber(ARGV[7])
local base = shard_base(KEYS[1])
local paused = pauses(base)
if paused and paused.all then return {OK, 0, 0, -1, now, -1, 0} end
local gone, late = {}, late_new()  -- leaving the pending index; release lateness
local out = {OK, 0, 0, -1, now, -1, 0}
local claimed, skipped, dead = 0, 0, 0
local hold = nil  -- the earliest due time of a debounce job put back (not yet due)
local not_sent, claimed_ids, unsent_by_state = {}, {}, {}
local ttl = tonumber(ARGV[8])
local shard, tg = shard_no(KEYS[1]), string.format('%d', now)

-- Expired or misfired: record it instead of claiming it; true when so.
local function held_back(id, jk)
  local r = redis.call('HMGET', jk, 'due', 'exp', 'ml', 'mf')
  local unsent, why = unsendable(now, r[1], r[2], r[3], r[4])
  local m = redis.call('HMGET', jk, 'msg', 'tp')
  local t = (not m[1]) and m[2] and template(base, m[2])
  if m[2] and not m[1] and not t then unsent, why = 'DEAD', LOST_TEMPLATE end
  if not unsent then return false end
  if t then  -- compact: its record names its task and queue; a dead letter keeps its message
    redis.call('HSET', jk, 'task', t.r.task, 'q', t.r.q)
    if unsent == 'DEAD' then redis.call('HSET', jk, 'msg', message_of(base, jk, id, tg)) end
  end
  redis.call('ZREM', KEYS[5], id)
  mark_unsent(jk, KEYS[6], id, unsent, why, now, ttl)
  not_sent[#not_sent + 1] = id; not_sent[#not_sent + 1] = unsent; not_sent[#not_sent + 1] = why
  unsent_by_state[unsent] = unsent_by_state[unsent] or {}
  table.insert(unsent_by_state[unsent], id)
  skipped = skipped + 1
  if unsent == 'DEAD' then dead = dead + 1 end
  return true
end

local function emit(id, jk)
  local r = redis.call('HMGET', jk, 'msg', 'ex', 'rk', 'q', 'ev', 'due', 'tp', 'b', 'a', 'k', 'e', 'i', 'r', 'pa')
  local due = tonumber(r[6])
  local early = due and due > now
  if not r[1] and r[7] then  -- compact: rendered from its template (whose routing fields it takes)
    local t = template(base, r[7])
    local f = {b = r[8], a = r[9], k = r[10], e = r[11], i = r[12], r = r[13], pa = r[14], due = due}
    r[1] = render(t, id, shard, f, tg, early and ('"' .. iso_utc(due) .. '"') or nil)
    r[2], r[3], r[4] = t.r.ex, t.r.rk, t.r.q
    redis.call('HSET', jk, 'task', t.r.task, 'q', t.r.q, 'tg', tg)
  elseif early then
    r[1] = early_eta(r[1], due)
  end
  redis.call('ZADD', KEYS[5], deadline, id)
  redis.call('HINCRBY', jk, 'claims', 1)
  claimed_ids[#claimed_ids + 1] = id
  out[#out + 1] = id
  out[#out + 1] = r[1]
  out[#out + 1] = r[2] or ''
  out[#out + 1] = r[3] or ''
  out[#out + 1] = r[4] or ''
  out[#out + 1] = r[5] or ''
  claimed = claimed + 1
end

-- Expired claims first: their scheduler died before it acknowledged them.
local stale = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, limit)
for _, id in ipairs(stale) do
  local jk = prefix .. id
  local st = redis.call('HGET', jk, 'st')
  if st == 'CLAIMED' and (redis.call('HEXISTS', jk, 'msg') == 1 or redis.call('HEXISTS', jk, 'b') == 1) then
    if not held_back(id, jk) then emit(id, jk) end
  else
    redis.call('ZREM', KEYS[5], id)
  end
end

local upto = now + (tonumber(ARGV[12]) or 0)
local L, S, tgone, parked = limits_load(base, ARGV, 13), {}, {}, 0  -- rate limits, their buckets; tenants' lanes left
-- One job taken out of the due index (from = nil) or out of a limit's wait set (from = its key).
local function consider(id, from)
  local jk = prefix .. id
  local st, due, task, q, tp, msg, b, dk, tn = unpack(redis.call('HMGET', jk, 'st', 'due', 'task', 'q', 'tp', 'msg',
    'b', 'dk', 'tn'))
  task, q = route_of(base, task, q, tp)
  if from then redis.call('HDEL', jk, 'lw') end
  local ks = st == 'SCHEDULED' and L and limit_keys(L, task, q, tn)
  if st == 'SCHEDULED' and tonumber(due) > now and (dk or ks) then
    -- a debounce job waits for its due time; a rate-limited one spends its token when it is due
    local d = tonumber(due)
    due_add(KEYS[1], KEYS[2], id, d, bucket_ms)
    tenant_add(base, tn, id, d)
    if (not hold) or d < hold then hold = d end
    return
  end
  if not from then tenant_push(tgone, tn, id) end
  if st == 'SCHEDULED' and paused and is_paused(paused, task, q) then  -- held back: stays pending
    redis.call('ZADD', base .. 'held', due, id)
    skipped = skipped + 1
  elseif st == 'SCHEDULED' and (msg or b) then
    local wait = ks and limit_admit(S, base, ks, now, from)
    if wait then  -- waits for a token: stays pending, in due order behind the others waiting
      limit_park(S, base, wait, jk, id, due)
      parked = parked + 1
      return
    end
    ix_push(gone, task, q, id)
    if not held_back(id, jk) then
      redis.call('HSET', jk, 'st', 'CLAIMED')
      emit(id, jk)
      late_add(late, math.max(0, now - tonumber(due)))  -- claimed early: not late
    end
  else
    if st == 'SCHEDULED' then ix_push(gone, task, q, id) end
    skipped = skipped + 1
  end
end
-- Jobs a rate limit held back first (they were due before the ones in the index now).
local ready = limit_ready(S, L, base, now, limit - claimed)
for i = 1, #ready, 2 do consider(ready[i], ready[i + 1]) end
local room = limit - claimed - #ready / 2
local ids, fair = {}, false
if room > 0 then ids, fair = take_fair(base, KEYS[1], KEYS[2], bucket_ms, upto, room) end
for _, id in ipairs(ids) do consider(id, nil) end
ix_flush(base, gone, 'rem')
tenant_flush(base, tgone)
late_save(base, 'rl', late)
local expired, misfired = 0, 0
for i = 2, #not_sent, 3 do
  if not_sent[i] == 'EXPIRED' then expired = expired + 1 elseif not_sent[i] == 'SKIPPED' then misfired = misfired + 1 end
end
stats_add(base, 'expired', expired, 'skipped', misfired, 'dead', dead)
if dead > 0 then
  dlq_trim(KEYS[6], prefix, now - tonumber(ARGV[9]), tonumber(ARGV[10]), 1000)
end
local e = earliest(KEYS[1], KEYS[2], bucket_ms)
local s = redis.call('ZRANGE', KEYS[5], 0, 0, 'WITHSCORES')
local s1 = #s > 0 and tonumber(s[2])
if s1 and ((not e) or s1 < e) then e = s1 end
set_next(KEYS[3], e)
if hold then
  e = next_visit(KEYS[1], KEYS[2], bucket_ms, now, upto, room > 0 and #ids >= room and claimed + skipped + parked > 0)
  if s1 and ((not e) or s1 < e) then e = s1 end
end
-- Jobs waiting for a token: the caller comes back when the first can go.
local lnext = limit_next(S, L, base, now)
if lnext and ((not hold) or lnext < hold) then hold = lnext end
limits_save(S, base, now)
if fair then out[7] = 1 end
out[2], out[3], out[4], out[6] = claimed, skipped, e or -1, hold or -1
for _, v in ipairs(not_sent) do out[#out + 1] = v end
log_change(KEYS[7], ARGV[11], 'CLAIMED', claimed_ids)
for state, ids in pairs(unsent_by_state) do log_change(KEYS[7], ARGV[11], state, ids) end
return out

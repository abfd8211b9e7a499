-- Release shaping at release time (`-- @include "shaping_release"`, after
-- "due_index" and "shaping"): fair selection across tenants, and rate limits
-- kept as one token bucket per limit per shard.
--
-- Rate limits. The app's `delayed_rate_limits` come in ARGV (key, rate per
-- second), the ones set at run time from the shard's `limits` hash (they win;
-- 0 lifts the app's). Each shard refills at its share of the rate (rate /
-- shards), so the fleet together releases at most the rate, whichever
-- scheduler holds which shard; a shard's bucket holds at most 500 ms of its
-- share (at least one token), which bounds the burst after a quiet spell.
-- A due job whose limit has no token waits in that limit's wait set, in due
-- order, and goes as tokens come; a job a limit applies to is never released
-- a look-ahead early (its token is spent when it goes, at its due time).

-- The limits in force on this shard: key -> tokens per ms (this shard's share), or nil when none.
-- `cfg`: ARGV from index `at`: shard count, n, then n pairs (key, rate per second).
local function limits_load(base, cfg, at)
  local shards, n = tonumber(cfg[at]) or 1, tonumber(cfg[at + 1]) or 0
  local L, any = {}, false
  for i = at + 2, at + 1 + 2 * n, 2 do L[cfg[i]] = tonumber(cfg[i + 1]); any = true end
  local o = redis.call('HGETALL', base .. 'limits')
  for i = 1, #o, 2 do
    local v = tonumber(o[i + 1])
    if v and v > 0 then L[o[i]] = v; any = true else L[o[i]] = nil end
  end
  if not any then return nil end
  local left = false
  for k, v in pairs(L) do L[k] = v / shards / 1000; left = true end
  if not left then return nil end
  return L
end

-- The rate (per ms) of limit key `k`: its own, or for a tenant the one of 'tenant:*'.
local function limit_rate(L, k)
  if not L then return nil end
  local r = L[k]
  if r then return r end
  if string.sub(k, 1, 7) == 'tenant:' then return L['tenant:*'] end
  return nil
end

-- The limit keys that apply to a job (a list, each key also mapped to its rate), or nil.
local function limit_keys(L, task, q, tn)
  if not L then return nil end
  local ks = nil
  local function add(k, r)
    if not r then return end
    ks = ks or {}
    ks[#ks + 1] = k; ks[k] = r
  end
  if task then add(task, L[task]) end
  if q then add('queue:' .. q, L['queue:' .. q]) end
  if tn and tn ~= '' then add('tenant:' .. tn, limit_rate(L, 'tenant:' .. tn)) end
  return ks
end

-- One limit's bucket in this call (S caches them: read once, written once by limits_save).
local function limit_state(S, base, k, rate, now)
  local b = S[k]
  if b then return b end
  local cap = math.max(1, rate * 500)
  local t = cap
  local v = redis.call('HGET', base .. 'tokens', k)
  if v then
    local sep = string.find(v, ':', 1, true)
    local had, at = tonumber(string.sub(v, 1, sep - 1)), tonumber(string.sub(v, sep + 1))
    t = math.min(cap, had + math.max(0, now - at) * rate)
  end
  b = {t = t, rate = rate, cap = cap}
  S[k] = b
  return b
end

local function limits_save(S, base, now)
  for k, b in pairs(S) do
    if b.t >= b.cap then redis.call('HDEL', base .. 'tokens', k)
    else redis.call('HSET', base .. 'tokens', k, string.format('%.6f:%d', b.t, now)) end
  end
end

-- Whether a due job under limits `ks` goes now: nil (one token taken from
-- each of its limits), or the key it must wait under (no token, or earlier
-- jobs wait there already; `from`: the wait set it comes from).
local function limit_admit(S, base, ks, now, from)
  for _, k in ipairs(ks) do
    local b = limit_state(S, base, k, ks[k], now)
    if b.t < 1 then return k end
    if k ~= from then
      if b.waiting == nil then b.waiting = redis.call('EXISTS', base .. 'lim:' .. k) == 1 end
      if b.waiting then return k end
    end
  end
  for _, k in ipairs(ks) do S[k].t = S[k].t - 1 end
  return nil
end

-- A due job waits for a token of limit `k` (still SCHEDULED and pending).
local function limit_park(S, base, k, jk, id, due)
  redis.call('ZADD', base .. 'lim:' .. k, due, id)
  redis.call('SADD', base .. 'lims', k)
  redis.call('HSET', jk, 'lw', k)
  if S[k] then S[k].waiting = true end
end

-- Waiting jobs whose limit has tokens again (or was lifted), earliest first
-- per limit, taken out of their wait sets: a list of id, key pairs (at most `room` jobs).
local function limit_ready(S, L, base, now, room)
  local out = {}
  for _, k in ipairs(redis.call('SMEMBERS', base .. 'lims')) do
    local left = room - #out / 2
    if left <= 0 then break end
    local wk = base .. 'lim:' .. k
    local rate = limit_rate(L, k)
    local n = left
    if rate then n = math.min(left, math.floor(limit_state(S, base, k, rate, now).t)) end
    if n > 0 then
      local ids = redis.call('ZRANGE', wk, 0, n - 1)
      if #ids > 0 then redis.call('ZREM', wk, unpack(ids)) end
      for _, id in ipairs(ids) do out[#out + 1] = id; out[#out + 1] = k end
      if redis.call('EXISTS', wk) == 0 then redis.call('SREM', base .. 'lims', k) end
    end
  end
  return out
end

-- The earliest time a waiting job can go (now when one can go already), or nil when none waits.
local function limit_next(S, L, base, now)
  local e = nil
  for _, k in ipairs(redis.call('SMEMBERS', base .. 'lims')) do
    local rate = limit_rate(L, k)
    local at = now
    if rate then
      local b = limit_state(S, base, k, rate, now)
      if b.t < 1 then at = now + math.ceil((1 - b.t) / rate) end
    end
    if (not e) or at < e then e = at end
  end
  return e
end

-- Up to `limit` due job ids taken out of the due index. With tenants' jobs
-- due, each due tenant first gets an equal share of the batch (its earliest
-- jobs), the rest of the batch goes to the earliest of every other due job:
-- a tenant with ten due jobs is not queued behind another's million.
-- Also returns whether several tenants had jobs due (then the scheduler shares
-- its round's batch between the shards it visits: scheduler/loop.py; one
-- tenant's flood alone goes in full batches).
local function take_fair(base, due_base, buckets, bucket_ms, upto, limit)
  local tns = redis.call('ZRANGEBYSCORE', base .. 'tns', '-inf', upto, 'LIMIT', 0, limit)
  if #tns == 0 then return take_due(due_base, buckets, bucket_ms, upto, limit), false end
  local share = math.max(1, math.floor(limit / (#tns + 1)))
  local out = {}
  for _, tn in ipairs(tns) do
    local want = math.min(share, limit - #out)
    if want <= 0 then break end
    local tq = base .. 'tq:' .. tn
    local r = redis.call('ZRANGEBYSCORE', tq, '-inf', upto, 'WITHSCORES', 'LIMIT', 0, want)
    -- Only a job still indexed at that due time (a lane entry can be stale: cancelled, moved),
    -- checked and taken per due set in one ZMSCORE and one ZREM, in due order.
    local seen, sets, byset = {}, {}, {}
    for i = 1, #r, 2 do
      local id, d = r[i], tonumber(r[i + 1])
      seen[#seen + 1] = id
      local k = due_key(due_base, d, bucket_ms)
      local g = byset[k]
      if not g then g = {ids = {}, dues = {}}; byset[k] = g; sets[#sets + 1] = k end
      g.ids[#g.ids + 1] = id; g.dues[#g.dues + 1] = d
    end
    for _, k in ipairs(sets) do
      local g, valid = byset[k], {}
      local sc = redis.call('ZMSCORE', k, unpack(g.ids))
      for j, id in ipairs(g.ids) do
        if sc[j] and tonumber(sc[j]) == g.dues[j] then valid[#valid + 1] = id end
      end
      if #valid > 0 then
        redis.call('ZREM', k, unpack(valid))
        if bucket_ms > 0 and redis.call('EXISTS', k) == 0 then redis.call('ZREM', buckets, k) end
        for _, id in ipairs(valid) do out[#out + 1] = id end
      end
    end
    if #seen > 0 then redis.call('ZREM', tq, unpack(seen)) end
    tenant_refresh(base, tn)
  end
  if #out < limit then
    for _, id in ipairs(take_due(due_base, buckets, bucket_ms, upto, limit - #out)) do out[#out + 1] = id end
  end
  return out, #tns > 1
end

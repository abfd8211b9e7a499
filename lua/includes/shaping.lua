-- Release shaping's bookkeeping (`-- @include "shaping"`): tenants' lanes and
-- the jobs a rate limit holds back. Every key is derived from the shard's
-- `{p}:{s}:` base (one slot). Python formats the same names (store/keys.py).
--
--   {p}:{s}:tq:<tenant>  ZSET  a tenant's jobs in the due index: id -> due
--   {p}:{s}:tns          ZSET  tenants with jobs in the due index -> their earliest due
--   {p}:{s}:limits       HASH  rate limits set at run time: key -> rate per second
--                              (0: the app's limit for that key is lifted)
--   {p}:{s}:tokens       HASH  this shard's token buckets: key -> '<tokens>:<at ms>' (absent: full)
--   {p}:{s}:lim:<key>    ZSET  due jobs waiting for a token of that limit: id -> due
--   {p}:{s}:lims         SET   the keys whose wait set is not empty
--
-- A record's `tn` is its tenant; `lw` the limit key it waits under (while it does).

-- A tenant's job enters the due index (a tenant's earliest due only decreases here).
local function tenant_add(base, tn, id, due)
  if not tn or tn == '' then return end
  redis.call('ZADD', base .. 'tq:' .. tn, due, id)
  redis.call('ZADD', base .. 'tns', 'LT', due, tn)
end

-- The tenant's earliest due, again read from its lane (or the tenant forgotten).
local function tenant_refresh(base, tn)
  local f = redis.call('ZRANGE', base .. 'tq:' .. tn, 0, 0, 'WITHSCORES')
  if #f == 0 then redis.call('ZREM', base .. 'tns', tn) else redis.call('ZADD', base .. 'tns', f[2], tn) end
end

local function tenant_rem(base, tn, id)
  if not tn or tn == '' then return end
  if redis.call('ZREM', base .. 'tq:' .. tn, id) == 1 then tenant_refresh(base, tn) end
end

-- Many jobs leaving tenants' lanes in one call: tenant_push per job, tenant_flush once.
local function tenant_push(acc, tn, id)
  if not tn or tn == '' then return end
  local l = acc[tn]
  if not l then l = {}; acc[tn] = l end
  l[#l + 1] = id
end
local function tenant_flush(base, acc)
  for tn, l in pairs(acc) do
    local k = base .. 'tq:' .. tn
    for i = 1, #l, 512 do redis.call('ZREM', k, unpack(l, i, math.min(i + 511, #l))) end
    tenant_refresh(base, tn)
  end
end

-- A job leaves a limit's wait set (cancelled, rescheduled, moved by a reshard).
local function limit_unpark(base, jk, id)
  local k = redis.call('HGET', jk, 'lw')
  if not k then return end
  local wk = base .. 'lim:' .. k
  redis.call('ZREM', wk, id)
  redis.call('HDEL', jk, 'lw')
  if redis.call('EXISTS', wk) == 0 then redis.call('SREM', base .. 'lims', k) end
end

-- A job (back) into the due index, and into its tenant's lane when it has one
-- (needs "due_index" and "ops" included before "shaping").
local function due_add_job(due_base, buckets, jk, id, due, bucket_ms)
  due_add(due_base, buckets, id, due, bucket_ms)
  local tn = redis.call('HGET', jk, 'tn')
  if tn then tenant_add(shard_base(due_base), tn, id, due) end
end

-- A job leaves the due index for good (cancelled, moved): out of its lane and any wait set too.
local function shaping_forget(base, jk, id)
  local tn, lw = unpack(redis.call('HMGET', jk, 'tn', 'lw'))
  if tn then tenant_rem(base, tn, id) end
  if lw then limit_unpark(base, jk, id) end
end

-- Compact records (`-- @include "compact"`, after "eta"; celery_delayed/store/compact.py
-- is the reference): a pending job keeps only what differs per job (fields tp, a,
-- k, b, e, i, r, pa); its template ({p}:{s}:tpl:<tp>, JSON) holds the rest of the
-- message and the routing fields its jobs share. A record with a `msg` field
-- is a full one, as before. Without `e`, the delayed_eta header is the job's
-- due time (a version 2 template: t.v == 2) or null (version 1).

-- The per-job message fields of a compact record, and `tg` (set at release).
local MSG_FIELDS = {'msg', 'a', 'k', 'b', 'e', 'i', 'r', 'pa', 'tg'}

-- Why a compact job whose template is gone is dead-lettered (it cannot be sent).
local LOST_TEMPLATE = 'its message template is gone from the store (expired or deleted): it cannot be sent'

-- Decoded templates of this call, by id (false: not in the store).
local templates = {}

-- The template `tp` of the shard whose keys start with `base` ({p}:{s}:), or false.
local function template(base, tp)
  local t = templates[tp]
  if t == nil then
    local text = redis.call('GET', base .. 'tpl:' .. tp)
    t = text and cjson.decode(text) or false
    templates[tp] = t
  end
  return t
end

-- The shard number in a key of the shard ('{p}:{<s>}:...').
local function shard_no(key)
  return string.match(key, ':{(%d+)}:')
end

-- task and queue of a job: its own fields, or its template's (a compact pending job).
local function route_of(base, task, q, tp)
  if (not task) and tp then
    local t = template(base, tp)
    if t then return t.r.task, t.r.q end
  end
  return task, q
end

-- The placeholders a template's `o` names, in the order render_job passes their values.
local SLOT = {id = 1, root = 2, parent = 3, argsrepr = 4, kwargsrepr = 5, shard = 6, tag = 7, body = 8,
  eta = 9, ceta = 10}

-- The message of a compact job (its fields a, k, b, e, i, r, pa and due),
-- with delivery tag "<id>.<tg>"; `ceta` is Celery's eta header as JSON
-- (released ahead of its due time: the due time), nil for null. Per job it
-- builds two array tables and one string: a release renders hundreds per call.
local function render_job(t, id, shard, a, k, b, e, i, r, pa, due, tg, ceta)
  local qid = i or ('"' .. id .. '"')
  local eta = e
  if not eta then
    if (t.v or 1) < 2 then eta = 'null'
    elseif ceta then eta = ceta  -- the same instant, formatted once
    else eta = '"' .. iso_utc(tonumber(due)) .. '"' end
  end
  local oi = t.oi
  if not oi then  -- the template's placeholders as slots, once per template and call
    oi = {}
    for j, name in ipairs(t.o) do oi[j] = SLOT[name] end
    t.oi = oi
  end
  local v = {qid, r or qid, pa or 'null', a or '""', k or '"{}"', shard,
    string.sub(qid, 1, -2) .. '.' .. tg .. '"', '"' .. (b or '') .. t.t .. '"', eta, ceta or 'null'}
  local p = t.p
  local out, m = {p[1]}, 1
  for j = 1, #oi do
    out[m + 1] = v[oi[j]]
    out[m + 2] = p[j + 1]
    m = m + 2
  end
  return table.concat(out)
end

-- render_job with the job's fields in a table f (a, k, b, e, i, r, pa, due).
local function render(t, id, shard, f, tg, ceta)
  return render_job(t, id, shard, f.a, f.k, f.b, f.e, f.i, f.r, f.pa, f.due, tg, ceta)
end

-- The message of record `jk` as it went out (or would go out) with tag suffix
-- `tg`: its `msg`, or rendered from its template; nil when it has neither.
local function message_of(base, jk, id, tg)
  local r = redis.call('HMGET', jk, 'msg', 'tp', 'a', 'k', 'b', 'e', 'i', 'r', 'pa', 'due')
  if r[1] then return r[1] end
  if not (r[2] and r[5]) then return nil end
  local t = template(base, r[2])
  if not t then return nil end
  return render(t, id, shard_no(jk),
    {a = r[3], k = r[4], b = r[5], e = r[6], i = r[7], r = r[8], pa = r[9], due = r[10]}, tg)
end

-- Drop a job's message (it started, or will never be sent): the full or the compact one.
-- `more` (optional): other fields to drop in the same command.
local function drop_message(jk, more)
  if more then
    for i = 1, #MSG_FIELDS do more[#more + 1] = MSG_FIELDS[i] end
    redis.call('HDEL', jk, unpack(more))
  else
    redis.call('HDEL', jk, unpack(MSG_FIELDS))
  end
end

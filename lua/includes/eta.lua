-- The `delayed_eta` header of a stored message (`-- @include "eta"`):
-- the job's due time as Celery writes an eta, which the worker side copies
-- into request.eta (celery_delayed.vocab.ETA_HEADER). A script that moves a
-- job to another due time rewrites it in place, so the task sees the time
-- it runs for. The producer writes it as `"delayed_eta": "<iso>"` or
-- `"delayed_eta": null` (kombu's JSON: ", " and ": " separators); a message
-- without it is left as it is.

-- Epoch ms as ISO 8601 in UTC, as Python's isoformat() writes it with microseconds.
-- Remembered for the rest of the call: a release formats many jobs due at one instant.
local iso_memo = {}
local function iso_utc(ms)
  local memo = iso_memo[ms]
  if memo then return memo end
  local s = math.floor(ms / 1000)
  local days = math.floor(s / 86400)
  local secs = s - days * 86400
  -- days since 1970-01-01 -> (year, month, day): H. Hinnant's civil_from_days
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400 + (m <= 2 and 1 or 0)
  memo = string.format('%04d-%02d-%02dT%02d:%02d:%02d.%03d000+00:00', y, m, d,
    math.floor(secs / 3600), math.floor(secs % 3600 / 60), secs % 60, ms - s * 1000)
  iso_memo[ms] = memo
  return memo
end

-- `msg` with its delayed_eta header set to `due_ms`.
local function with_eta(msg, due_ms)
  local _, vstart = string.find(msg, '"delayed_eta": ', 1, true)
  if not vstart then return msg end
  local vend
  if string.sub(msg, vstart + 1, vstart + 4) == 'null' then
    vend = vstart + 4
  else
    vend = string.find(msg, '"', vstart + 2, true)  -- the closing quote (an ISO time has no escapes)
    if not vend then return msg end
  end
  return string.sub(msg, 1, vstart) .. '"' .. iso_utc(due_ms) .. '"' .. string.sub(msg, vend + 1)
end

-- `msg` released before it is due: Celery's own `eta` header set to its due
-- time by the Redis clock (one clock: not the producer's delayed_eta, which a
-- skewed app clock may have written early), so the worker holds it until then
-- (as it holds apply_async(eta=)); the task still sees delayed_eta as
-- request.eta (celery_delayed/worker/eta.py). kombu writes the headers in
-- Celery's order, `eta` right after `shadow`: the first `, "eta": null` is
-- that header (a JSON string cannot hold an unescaped quote).
local function early_eta(msg, due_ms)
  local a, b = string.find(msg, ', "eta": null', 1, true)
  if not a then return msg end
  return string.sub(msg, 1, a - 1) .. ', "eta": "' .. iso_utc(due_ms) .. '"' .. string.sub(msg, b + 1)
end

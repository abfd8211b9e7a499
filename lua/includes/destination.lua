-- Where a released job's message goes on the direct path (`-- @include "destination"`),
-- as kombu's Redis transport routes it (see celery_delayed/store/broker_layout.py).

local SEP = '\6\22'  -- kombu.transport.redis.Channel.sep

-- The Redis lists the message of a record goes to: its list key `lk`
-- (anonymous exchange); the bound queues of a named direct exchange (binding
-- set `bx`, routing key `rk`, priority suffix `ps`), or kombu's dead-letter
-- queue when none is bound ('' = dropped, as kombu drops it: no list); or,
-- for a record stored for the publish path, its queue's list.
local function dest_lists(gkp, lk, bx, rk, ps, q, dead_queue)
  if lk then return {lk} end
  if bx then
    local out = {}
    for _, m in ipairs(redis.call('SMEMBERS', bx)) do
      local a = string.find(m, SEP, 1, true)
      if a and string.sub(m, 1, a - 1) == (rk or '') then
        local b = string.find(m, SEP, a + 2, true)
        out[#out + 1] = gkp .. string.sub(m, b + 2) .. (ps or '')
      end
    end
    if #out == 0 and dead_queue ~= '' then out[1] = gkp .. dead_queue .. (ps or '') end
    return out
  end
  return {gkp .. q}
end

-- Release-time checks of a due job: Celery's `expires` and the misfire policy.
-- Record fields (see celery_delayed/store/records.py): exp = expires, epoch ms; ml = max lateness, ms;
-- mf = misfire policy when late ('skip' or 'dead'; absent = run anyway).

-- The state a due job gets instead of being sent, and why; nil = send it.
local function unsendable(now, due, exp, ml, mf)
  -- Released early (look-ahead), a job runs at its due time: expired if it would be by then.
  if exp and math.max(now, tonumber(due) or now) >= tonumber(exp) then
    return 'EXPIRED', 'expired: expires ' .. exp .. ' ms <= released ' .. now .. ' ms'
  end
  if ml and (mf == 'skip' or mf == 'dead') then
    local late = now - tonumber(due)
    if late > tonumber(ml) then
      local why = 'misfire: released ' .. late .. ' ms late, max_lateness ' .. ml .. ' ms'
      if mf == 'skip' then return 'SKIPPED', why end
      return 'DEAD', why
    end
  end
  return nil, nil
end

-- Record that a due job was not sent. EXPIRED / SKIPPED drop the message and
-- expire like any finished record; DEAD keeps the message (it can be requeued)
-- and no ttl, and is indexed in the shard's dead-letter set, whose trimming
-- owns its lifetime.
local function mark_unsent(jk, dlq, id, state, reason, now, ttl)
  if state == 'DEAD' then
    -- the dead-letter fields of dead.lua, so `delayed dlq` lists it like any other
    redis.call('HSET', jk, 'st', state, 'reason', reason, 'died', now, 'etype', 'Misfire', 'emsg', reason)
    redis.call('ZADD', dlq, now, id)
    redis.call('HDEL', jk, 'a', 'k', 'b', 'e', 'i', 'r', 'pa', 'tg')  -- a compact one is in `msg` by now
  else
    redis.call('HSET', jk, 'st', state, 'reason', reason, 'finished', now)
    redis.call('HDEL', jk, 'msg', 'a', 'k', 'b', 'e', 'i', 'r', 'pa', 'tg')  -- its message, full or compact
    redis.call('PEXPIRE', jk, ttl)
  end
end

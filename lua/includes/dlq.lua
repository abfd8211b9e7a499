-- The dead-letter set of one shard (`-- @include "dlq"`). A dead letter is its
-- job record (st=DEAD) indexed in the shard's dlq sorted set by its time of
-- death (epoch ms).

-- Forget one dead letter: its index entry, and its record while still DEAD
-- (a record requeued or replaced meanwhile is not ours to delete).
local function dlq_drop(dlq, prefix, id)
  redis.call('ZREM', dlq, id)
  local jk = prefix .. id
  if redis.call('HGET', jk, 'st') == 'DEAD' then redis.call('DEL', jk) end
end

-- Bound the shard's dead letters: drop those that died at or before `cutoff`
-- (at most `limit` per call, so one call stays short), then the oldest ones
-- beyond `max_len` (-1: no bound). Returns how many were dropped.
local function dlq_trim(dlq, prefix, cutoff, max_len, limit)
  local n = 0
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', dlq, '-inf', cutoff, 'LIMIT', 0, limit)) do
    dlq_drop(dlq, prefix, id)
    n = n + 1
  end
  if max_len >= 0 then
    local over = redis.call('ZCARD', dlq) - max_len
    if over > 0 then
      for _, id in ipairs(redis.call('ZRANGE', dlq, 0, math.min(over, limit) - 1)) do
        dlq_drop(dlq, prefix, id)
        n = n + 1
      end
    end
  end
  return n
end

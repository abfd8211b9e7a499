--[[ note_fallback: count a delayed send that went to the broker as an ETA message, not to the store.

With delayed_intercept_eta, a call the store cannot take (a message it
refuses to build, positional publish arguments) is sent by Celery as before,
as a broker ETA message: the producer warns and counts it here, so that
`delayed status` and the metrics show it. Kept per shard (the shard of the
task id); the fleet's figure is the sum over the shards.

KEYS[1]  the shard's stats hash    {p}:{s}:stats
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  the counter's field name  (vocab.ETA_FALLBACKS)
ARGV[3]  the last one's field name (vocab.ETA_FALLBACK_LAST), set to "<now>|<what>"
ARGV[4]  what it was: "<task name>|<reason>"

Returns the shard's count, this one included.
]]
-- @include "common"

local n = redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
redis.call('HSET', KEYS[1], ARGV[3], now_ms(ARGV[1]) .. '|' .. ARGV[4])
return n

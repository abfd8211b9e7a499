--[[ purge_dead: delete dead letters of one shard that died long enough ago.

KEYS[1]  dead letters      {p}:{s}:dlq
ARGV[1]  now, epoch ms ('' = the Redis server's TIME)
ARGV[2]  job key prefix    {p}:{s}:job:
ARGV[3]  age, ms: letters that died at or before now - age go ('' = all)
ARGV[4]  most letters to delete in this call

Returns the number deleted; call again while it equals ARGV[4].

Runs when Redis is at maxmemory (@flags below): it frees memory or holds it
steady, so a full store keeps draining.
]]
-- @flags allow-oom
-- @include "common"
-- @include "dlq"

local cutoff = '+inf'
if ARGV[3] ~= '' then cutoff = now_ms(ARGV[1]) - tonumber(ARGV[3]) end
return dlq_trim(KEYS[1], ARGV[2], cutoff, -1, tonumber(ARGV[4]))

--[[ purge_dead: delete dead letters of one shard that died at or before a time.

KEYS[1]  dead letters      {p}:{s}:dlq
ARGV[1]  job key prefix    {p}:{s}:job:
ARGV[2]  cutoff, epoch ms: letters that died at or before it go ('' = all)
ARGV[3]  most letters to delete in this call

Returns the number deleted; call again while it equals ARGV[3].
]]
-- @include "dlq"

local cutoff = ARGV[2] == '' and '+inf' or ARGV[2]
return dlq_trim(KEYS[1], ARGV[1], cutoff, -1, tonumber(ARGV[3]))

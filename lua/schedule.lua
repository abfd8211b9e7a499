--[[ schedule: store new jobs of one shard and index them by due time.

KEYS[1]  due set base      {p}:{s}:due
KEYS[2]  bucket index      {p}:{s}:buckets
KEYS[3]  next due key      {p}:{s}:next
ARGV[1]  job key prefix    {p}:{s}:job:
ARGV[2]  bucket width, ms (0 = one due set)
ARGV[3]  wake channel      {p}:wake
ARGV[4]  shard number
ARGV[5]  now, epoch ms ('' = the Redis server's TIME)
ARGV[6]  F, the number of record fields each job carries
ARGV[7 .. 6+F]  the record field names
then per job: id, due, F field values (an empty value is not stored).
  due is '<ms>', an epoch time (may be in the past: released at once), or
  '+<ms>', a delay added to now (the Redis server's clock).

The record gets st=SCHEDULED, due, created (now) and the given fields.
Returns one entry per job, in order: '=<due ms>' when stored; '<state>|<due>'
of the record already held under that id (nothing is written for that job).
]]
-- @include "common"

local prefix, bucket_ms = ARGV[1], tonumber(ARGV[2])
local channel, shard = ARGV[3], ARGV[4]
local now = now_ms(ARGV[5])
local nf = tonumber(ARGV[6])
local names = {}
for i = 1, nf do names[i] = ARGV[6 + i] end

local out, i, earliest_new = {}, 7 + nf, nil
while i <= #ARGV do
  local id, spec = ARGV[i], ARGV[i + 1]
  local due
  if string.sub(spec, 1, 1) == '+' then due = now + tonumber(string.sub(spec, 2)) else due = tonumber(spec) end
  local jk = prefix .. id
  local held = redis.call('HMGET', jk, 'st', 'due')
  if held[1] then
    out[#out + 1] = held[1] .. '|' .. (held[2] or '')
  else
    local rec = {'st', 'SCHEDULED', 'due', due, 'created', now}
    for f = 1, nf do
      local v = ARGV[i + 1 + f]
      if v ~= '' then rec[#rec + 1] = names[f]; rec[#rec + 1] = v end
    end
    redis.call('HSET', jk, unpack(rec))
    due_add(KEYS[1], KEYS[2], id, due, bucket_ms)
    if (not earliest_new) or due < earliest_new then earliest_new = due end
    out[#out + 1] = '=' .. due
  end
  i = i + 2 + nf
end
if earliest_new then maybe_wake(KEYS[3], channel, shard, earliest_new) end
return out

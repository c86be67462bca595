-- Release: KEYS[1] lock; ARGV[1] owner, ARGV[2] release channel.
-- Owner-checked delete, then a message that wakes the waiters. Answers 1 if
-- deleted. The stored value is the owner, or the owner and a newline followed
-- by the holder's record.
-- On Redis Cluster the backend runs it with SPUBLISH in place of PUBLISH, so
-- the message reaches only the key's shard (the channel is in the key's slot).
-- A hash of readers or permits there (WRONGTYPE) is not the owner's.
local held = redis.pcall('GET', KEYS[1])
if type(held) ~= 'string' then
  held = false
end
if held == ARGV[1] or (held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '\n') then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '1')
  return 1
end
return 0

-- Release: KEYS[1] lock; ARGV[1] owner, ARGV[2] release channel.
-- Owner-checked delete, then a message that wakes the waiters. Answers 1 if deleted.
-- On Redis Cluster the backend runs it with SPUBLISH in place of PUBLISH, so
-- the message reaches only the key's shard (the channel is in the key's slot).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], '1')
  return 1
end
return 0

-- Renew: KEYS[1] lock; ARGV[1] owner, ARGV[2] ttl (ms). Owner-checked PEXPIRE.
-- Answers 1 if extended.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0

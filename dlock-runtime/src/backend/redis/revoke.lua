-- Revoke: KEYS[1] lock, KEYS[2] its revocation mark; ARGV[1] release channel.
-- Deletes the key whoever holds it, marks its owner revoked for longer than
-- the lease it had left (so the holder's next renewal answers 2, revoked,
-- rather than 0), and wakes the waiters. Answers {value, remaining ms}, or
-- nil for a free key. The fence counter is not touched: the next grant's
-- token is larger than the revoked one.
-- On Redis Cluster the backend runs it with SPUBLISH in place of PUBLISH.
local held = redis.call('GET', KEYS[1])
if not held then
  return false
end
local ttl = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
local mark = ttl
if mark < 0 then
  mark = 60000
end
-- The mark is the set of the owners revoked within their lease: a holder
-- revoked after an earlier one does not hide the earlier one's revocation.
-- It lives as long as its longest-lived owner needs.
redis.call('SADD', KEYS[2], string.match(held, '^[^\n]*'))
if redis.call('PTTL', KEYS[2]) < mark + 1000 then
  redis.call('PEXPIRE', KEYS[2], mark + 1000)
end
redis.call('PUBLISH', ARGV[1], '1')
return {held, ttl}

-- Renew a reader or a permit: KEYS[1] lock (the hash of acquire_held.lua),
-- KEYS[2] its revocation mark; ARGV[1] owner, ARGV[2] ttl (ms), ARGV[3] the
-- holder's field (`r:<owner>` or the slot). Owner- and slot-checked: the
-- holder's own expiry moves to now + ttl, and the key's TTL is never left
-- shorter than it. Answers 1 if extended, 2 if the owner's hold was
-- revoked, else 0.
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local value = redis.pcall('HGET', KEYS[1], ARGV[3])
if type(value) == 'string' then
  local expiry, rest = string.match(value, '^(%d+) (.*)$')
  if rest and (rest == owner or string.sub(rest, 1, #owner + 1) == owner .. '\n') then
    local now = redis.call('TIME')
    local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
    if tonumber(expiry) > now_ms then
      redis.call('HSET', KEYS[1], ARGV[3], string.format('%.0f', now_ms + ttl) .. ' ' .. rest)
      if redis.call('PTTL', KEYS[1]) < ttl then
        redis.call('PEXPIRE', KEYS[1], ttl)
      end
      return 1
    end
  end
end
if KEYS[2] and redis.call('SISMEMBER', KEYS[2], owner) == 1 then
  return 2
end
return 0

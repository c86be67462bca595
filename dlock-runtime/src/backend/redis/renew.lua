-- Renew: KEYS[1] lock, KEYS[2] (optional) its revocation mark (the set of
-- the owners revoked within their lease); ARGV[1]
-- owner, ARGV[2] ttl (ms). Owner-checked PEXPIRE (the stored value is the
-- owner, or the owner and a newline followed by the holder's record).
-- Answers 1 if extended, 2 if the owner's hold was revoked, else 0.
-- A hash of readers or permits there (WRONGTYPE) is not the owner's.
local held = redis.pcall('GET', KEYS[1])
if type(held) ~= 'string' then
  held = false
end
if held == ARGV[1] or (held and string.sub(held, 1, #ARGV[1] + 1) == ARGV[1] .. '\n') then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if KEYS[2] and redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  return 2
end
return 0

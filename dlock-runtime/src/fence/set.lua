-- KEYS[1] the value, KEYS[2] its fence (same slot); ARGV[1] the value,
-- ARGV[2] the token (decimal, no leading zeros), ARGV[3] the fence's
-- retention in ms. Answers nil when written, else the larger token seen.
local seen = redis.call('GET', KEYS[2])
local token = ARGV[2]
-- Decimal strings compare as numbers by length, then byte by byte: exact for
-- every 64-bit token (Lua's numbers are doubles).
if seen and (#seen > #token or (#seen == #token and seen > token)) then
  return seen
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], token, 'PX', ARGV[3])
return false

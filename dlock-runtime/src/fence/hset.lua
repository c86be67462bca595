-- KEYS[1] the hash, KEYS[2] its fences (a hash in the same slot, one field
-- per field of KEYS[1]); ARGV[1] the field, ARGV[2] the value, ARGV[3] the
-- token (decimal, no leading zeros), ARGV[4] the fences' retention in ms.
-- Answers nil when written, else the larger token seen for the field.
local seen = redis.call('HGET', KEYS[2], ARGV[1])
local token = ARGV[3]
if seen and (#seen > #token or (#seen == #token and seen > token)) then
  return seen
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], token)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return false

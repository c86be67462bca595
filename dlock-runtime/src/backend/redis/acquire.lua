-- Acquire: KEYS[1] lock, KEYS[2] fence counter (one per hash slot on a
-- cluster, one per server otherwise: never a key per lock name); ARGV[1]
-- owner, ARGV[2] lease (ms), ARGV[3] the holder's record. Answers
-- {1, token} or {0, the holder's remaining ms}. The token is the larger of
-- the counter + 1 and the server clock in µs, so a counter lost (a restart
-- without persistence, a DEL) or behind (a replica promoted before it heard
-- the last grants) never repeats a token (given server clocks that agree
-- within the replication lag).
-- The stored value is `owner\n<token> <granted-at µs> <record>`: the owner
-- first, so owner checks compare the text up to the first newline.
-- Sent twice for one owner (a retry), it grants again: the lease restarts
-- from now and a new, larger token is issued.
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] and string.sub(held, 1, #ARGV[1] + 1) ~= ARGV[1] .. '\n' then
  return {0, redis.call('PTTL', KEYS[1])}
end
-- The clock in µs as decimal text, built from TIME's two strings: handing
-- Redis a Lua number costs a float-to-text conversion on every grant.
local now = redis.call('TIME')
local clock = now[1] .. string.rep('0', 6 - #now[2]) .. now[2]
local token = clock
-- One SET … GET (Redis >= 6.2) reads and writes the counter. Only when it was
-- ahead of the clock (same-length decimal text compares as numbers) is it
-- written again, with its value + 1.
local last = redis.call('SET', KEYS[2], token, 'GET')
if last and (#last > #token or (#last == #token and last >= token)) then
  local ahead = tonumber(last)
  if ahead then
    token = string.format('%.0f', ahead + 1)
    redis.call('SET', KEYS[2], token)
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. '\n' .. token .. ' ' .. clock .. ' ' .. ARGV[3], 'PX', ARGV[2])
return {1, tonumber(token)}

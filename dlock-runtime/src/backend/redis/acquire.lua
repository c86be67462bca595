-- Acquire: KEYS[1] lock, KEYS[2] fence counter (one per hash slot on a
-- cluster, one per server otherwise: never a key per lock name); ARGV[1]
-- owner, ARGV[2] lease (ms). Answers {1, token} or {0, the holder's remaining
-- ms}. The token is the larger of the counter + 1 and the server clock in µs,
-- so a counter lost (a restart without persistence, a DEL) or behind (a
-- replica promoted before it heard the last grants) never repeats a token
-- (given server clocks that agree within the replication lag).
-- Sent twice for one owner (a retry), it grants again: the lease restarts
-- from now and a new, larger token is issued.
-- The counter is read and written by one `SET … GET` (Redis >= 6.2); only
-- when it is ahead of the clock is it written a second time.
local function next_token()
  local now = redis.call('TIME')
  local token = tonumber(now[1]) * 1000000 + tonumber(now[2])
  local last = tonumber(redis.call('SET', KEYS[2], token, 'GET'))
  if last and last >= token then
    token = last + 1
    redis.call('SET', KEYS[2], token)
  end
  return token
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {1, next_token()}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, next_token()}
end
return {0, redis.call('PTTL', KEYS[1])}

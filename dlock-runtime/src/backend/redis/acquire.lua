-- Acquire: KEYS[1] lock, KEYS[2] fence counter; ARGV[1] owner, ARGV[2] lease (ms).
-- Answers {1, token} or {0, the holder's remaining ms}; sent twice for one owner
-- (a retry), it answers the same grant. A missing counter (first use, or a
-- server restarted without persistence) is seeded from the server clock in µs,
-- so tokens keep growing across such a restart.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local token = redis.call('INCR', KEYS[2])
  if token == 1 then
    local now = redis.call('TIME')
    token = tonumber(now[1]) * 1000000 + tonumber(now[2])
    redis.call('SET', KEYS[2], token)
  end
  return {1, token}
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return {1, tonumber(redis.call('GET', KEYS[2]))}
end
return {0, redis.call('PTTL', KEYS[1])}

-- Read a lock's holders: KEYS[1] lock. Answers {'s', value, remaining ms}
-- for the whole key's holder, {'h', server ms, field, value, …} for the hash
-- of readers or permits (acquire_held.lua), or nil for a free key.
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'string' then
  return {'s', redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
elseif kind == 'hash' then
  local now = redis.call('TIME')
  local answer = {'h', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)}
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all do
    answer[#answer + 1] = all[i]
  end
  return answer
end
return false

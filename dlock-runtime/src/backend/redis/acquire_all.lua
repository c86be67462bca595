-- Acquire several keys in one step, all or none: KEYS[1..n-1] locks (in
-- the runtime's canonical order, all in one hash slot on a cluster), KEYS[n]
-- the fence counter they share; ARGV as the single-key acquire script's
-- (ARGV[1] owner, ARGV[2] lease in ms, ARGV[3] the holder's record). Answers {1, token of each lock} or
-- {0, the index of a busy lock (from 1), its holder's remaining ms}; a busy
-- lock leaves every lock untaken. Each lock is then taken by the single-key
-- acquire script's own text (inserted below as a function, unchanged), so
-- each token follows its rule: the larger of the counter + 1 and the clock.
local function acquire_one(KEYS, ARGV)
--ACQUIRE--
end
local locks = #KEYS - 1
for i = 1, locks do
  local holder = redis.call('GET', KEYS[i])
  -- The stored value starts with its owner's line (see the acquire script).
  if holder and holder ~= ARGV[1] and string.sub(holder, 1, #ARGV[1] + 1) ~= ARGV[1] .. '\n' then
    return {0, i, redis.call('PTTL', KEYS[i])}
  end
end
local answer = {1}
for i = 1, locks do
  answer[i + 1] = acquire_one({KEYS[i], KEYS[#KEYS]}, ARGV)[2]
end
return answer

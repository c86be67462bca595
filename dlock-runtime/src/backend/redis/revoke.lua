-- Revoke: KEYS[1] lock, KEYS[2] its revocation mark; ARGV[1] release channel.
-- Deletes the key whoever holds it (the whole key, or every reader or
-- permit of its hash), marks each owner revoked for longer than the lease it
-- had left (so the holder's next renewal answers 2, revoked, rather than 0),
-- and wakes the waiters. Answers what it removed as the read script reads
-- it ({'s', value, remaining ms} or {'h', server ms, field, value, …}), or
-- nil for a free key. The fence counter is not touched: the next grant's
-- token is larger than the revoked ones.
-- On Redis Cluster the backend runs it with SPUBLISH in place of PUBLISH.
local kind = redis.call('TYPE', KEYS[1]).ok
local answer
local owners = {}
local mark
if kind == 'string' then
  local held = redis.call('GET', KEYS[1])
  local ttl = redis.call('PTTL', KEYS[1])
  answer = {'s', held, ttl}
  owners[1] = string.match(held, '^[^\n]*')
  mark = ttl
elseif kind == 'hash' then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  answer = {'h', now_ms}
  mark = 0
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    answer[#answer + 1] = all[i]
    answer[#answer + 1] = all[i + 1]
    if all[i] ~= 'n' then
      local expiry, rest = string.match(all[i + 1], '^(%d+) (.*)$')
      if rest then
        owners[#owners + 1] = string.match(rest, '^[^\n]*')
        mark = math.max(mark, (tonumber(expiry) or 0) - now_ms)
      end
    end
  end
else
  return false
end
redis.call('DEL', KEYS[1])
if mark < 0 then
  mark = 60000
end
-- The mark is the set of the owners revoked within their lease: a holder
-- revoked after an earlier one does not hide the earlier one's revocation.
-- It lives as long as its longest-lived owner needs.
for _, revoked in ipairs(owners) do
  redis.call('SADD', KEYS[2], revoked)
end
if #owners > 0 and redis.call('PTTL', KEYS[2]) < mark + 1000 then
  redis.call('PEXPIRE', KEYS[2], mark + 1000)
end
redis.call('PUBLISH', ARGV[1], '1')
return answer

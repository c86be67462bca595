-- Release in any mode: KEYS[1] lock, KEYS[2] the waiting-writer mark;
-- ARGV[1] owner, ARGV[2] release channel, ARGV[3] the holder's field
-- (`r:<owner>`, a slot), or empty: whatever the owner holds of the key (the
-- undo of an abandoned attempt, whose slot is unknown). Owner-checked: the
-- owner's writer mark, its whole-key hold, or its reader or permit; the
-- hash goes with its last holder, else its TTL becomes its longest holder's.
-- A message wakes one waiter. Answers 1 if anything was removed.
local owner = ARGV[1]
local function owns(value)
  return value == owner or string.sub(value, 1, #owner + 1) == owner .. '\n'
end
local removed = 0
if redis.call('GET', KEYS[2]) == owner then
  redis.call('DEL', KEYS[2])
  removed = 1
end
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'string' then
  if owns(redis.call('GET', KEYS[1])) then
    redis.call('DEL', KEYS[1])
    removed = 1
  end
elseif kind == 'hash' then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local latest = nil
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local field, value = all[i], all[i + 1]
    if field ~= 'n' then
      local expiry, rest = string.match(value, '^(%d+) (.*)$')
      expiry = tonumber(expiry) or 0
      if (field == ARGV[3] or ARGV[3] == '') and rest and owns(rest) then
        redis.call('HDEL', KEYS[1], field)
        removed = 1
      elseif expiry <= now_ms then
        redis.call('HDEL', KEYS[1], field)
      elseif not latest or expiry > latest then
        latest = expiry
      end
    end
  end
  if latest then
    redis.call('PEXPIRE', KEYS[1], latest - now_ms)
  else
    redis.call('DEL', KEYS[1])
  end
end
if removed == 1 then
  redis.call('PUBLISH', ARGV[2], '1')
end
return removed

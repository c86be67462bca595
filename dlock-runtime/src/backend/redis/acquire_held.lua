-- Acquire in any mode: KEYS[1] lock, KEYS[2] fence counter, KEYS[3] the
-- waiting-writer mark; ARGV[1] owner, ARGV[2] lease (ms), ARGV[3] the
-- holder's record, ARGV[4] the mode: `x` (the whole key), `r` (a reader) or
-- the number of permits of a semaphore, ARGV[5] release channel.
-- Answers {1, token, slot (-1: none)}, {0, ms until it is worth trying
-- again} or {2, what holds the key: `x`, `r` or a number of permits}.
--
-- The whole key is held as the plain lock's string (the acquire script's
-- value). Readers and permits are held in a hash at the same key: field `n`
-- is `r` (readers) or the number of permits, and each holder is one field
-- (`r:<owner>` for a reader, the slot number for a permit) whose value is
-- `<expiry, server ms> <owner>\n<token> <granted-at µs> <record>`: each
-- holder has its own expiry, purged here, and the key's own TTL is never
-- shorter than its longest holder's, so the hash goes once every holder
-- has. A plain lock's scripts meet the hash as WRONGTYPE and hand over to
-- this one.
local owner, lease, mode = ARGV[1], tonumber(ARGV[2]), ARGV[4]
local now = redis.call('TIME')
local clock = now[1] .. string.rep('0', 6 - #now[2]) .. now[2]
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
-- The token: the acquire script's rule (the larger of the shared counter + 1
-- and the clock in µs), so one sequence serves every mode of a key.
local function next_token()
  local token = clock
  local last = redis.call('SET', KEYS[2], token, 'GET')
  if last and (#last > #token or (#last == #token and last >= token)) then
    local ahead = tonumber(last)
    if ahead then
      token = string.format('%.0f', ahead + 1)
      redis.call('SET', KEYS[2], token)
    end
  end
  return token
end
local function owns(value)
  return value == owner or string.sub(value, 1, #owner + 1) == owner .. '\n'
end
local function own_mark_gone()
  if redis.call('GET', KEYS[3]) == owner then
    redis.call('DEL', KEYS[3])
  end
end
local function grant_whole()
  local token = next_token()
  redis.call('SET', KEYS[1], owner .. '\n' .. token .. ' ' .. clock .. ' ' .. ARGV[3], 'PX', lease)
  own_mark_gone()
  return {1, tonumber(token), -1}
end
local function grant_field(field)
  local token = next_token()
  redis.call('HSET', KEYS[1], field,
    string.format('%.0f', now_ms + lease) .. ' ' .. owner .. '\n' .. token .. ' ' .. clock .. ' ' .. ARGV[3])
  if redis.call('PTTL', KEYS[1]) < lease then
    redis.call('PEXPIRE', KEYS[1], lease)
  end
  return token
end
local function writer_waits()
  local mark = redis.call('GET', KEYS[3])
  if mark and mark ~= owner then
    return math.max(redis.call('PTTL', KEYS[3]), 1)
  end
  return nil
end

local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'string' then
  local held = redis.call('GET', KEYS[1])
  if mode == 'x' then
    if owns(held) then
      return grant_whole()
    end
    return {0, redis.call('PTTL', KEYS[1])}
  elseif mode == 'r' then
    return {0, redis.call('PTTL', KEYS[1])}
  end
  return {2, 'x'}
end

local held_as = nil
local earliest = nil
local count = 0
local taken = {}
local mine = nil
if kind == 'hash' then
  held_as = redis.call('HGET', KEYS[1], 'n')
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local field, value = all[i], all[i + 1]
    if field ~= 'n' then
      local expiry, rest = string.match(value, '^(%d+) (.*)$')
      expiry = tonumber(expiry) or 0
      if expiry <= now_ms then
        redis.call('HDEL', KEYS[1], field)
      else
        count = count + 1
        taken[field] = true
        if owns(rest) then
          mine = field
        end
        if not earliest or expiry < earliest then
          earliest = expiry
        end
      end
    end
  end
  if count == 0 then
    redis.call('DEL', KEYS[1])
    held_as = nil
  end
end

if held_as == nil then
  -- Free.
  if mode == 'x' then
    return grant_whole()
  end
  if mode == 'r' then
    local wait = writer_waits()
    if wait then
      return {0, wait}
    end
  end
  redis.call('HSET', KEYS[1], 'n', mode)
  if mode == 'r' then
    local token = grant_field('r:' .. owner)
    redis.call('PUBLISH', ARGV[5], '1')
    return {1, tonumber(token), -1}
  end
  return {1, tonumber(grant_field('0')), 0}
end

if mode == 'x' then
  if held_as ~= 'r' then
    return {2, held_as}
  end
  -- Readers hold it: this writer now waits, and holds new readers back.
  -- The mark is short (a crashed writer holds readers back briefly, not
  -- for its lease); its retries, three per mark's life, renew it.
  local mark_ms = math.min(lease, 3000)
  redis.call('SET', KEYS[3], owner, 'PX', mark_ms)
  return {0, math.max(math.min(earliest - now_ms, math.floor(mark_ms / 3)), 1)}
end
if mode ~= held_as then
  return {2, held_as}
end
if mode == 'r' then
  local wait = writer_waits()
  if wait then
    return {0, wait}
  end
  local token = grant_field('r:' .. owner)
  -- One reader granted wakes the next waiter, so readers that waited
  -- behind a writer enter one after another without a release each.
  redis.call('PUBLISH', ARGV[5], '1')
  return {1, tonumber(token), -1}
end
if mine then
  -- A retry of a grant that did reach the server: the same slot again.
  return {1, tonumber(grant_field(mine)), tonumber(mine)}
end
local permits = tonumber(mode)
if count >= permits then
  return {0, earliest - now_ms}
end
for slot = 0, permits - 1 do
  local field = tostring(slot)
  if not taken[field] then
    return {1, tonumber(grant_field(field)), slot}
  end
end
return {0, earliest - now_ms}

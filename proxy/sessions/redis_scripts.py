"""The Lua scripts of the Redis session store (`proxy.sessions.redis_store`).

Both take KEYS[1] = the session hash, KEYS[2] = the client's session set (a
sorted set: session key -> the unix time it expires; used only while
`sessions.max_sessions_per_client` > 0).

A load never needs a write: it reads the history first, and refreshing
`last_active`, the TTL and the session's expiry in the client set is best
effort (`pcall`): a Redis that refuses writes (OOM under `noeviction`, a
read-only replica, MISCONF) still serves the history, and the refusal comes
back as the load's second value. Redis 7 runs a script without flags on a
replica or past maxmemory and refuses only its write commands.
"""

from __future__ import annotations

__all__ = ["APPEND_LUA", "LOAD_LUA"]

# ARGV: ttl_s, now, cap (0 = off).
# Returns {history or nil, refresh error or '', live sessions of the client,
# the earliest expiry among them (or nil)}; the last two only for a session
# that does not exist, with a cap.
LOAD_LUA = """
local raw = redis.call('HGET', KEYS[1], 'history')
local ttl = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
if raw then
  local ok, err = pcall(function()
    redis.call('HSET', KEYS[1], 'last_active', ARGV[2])
    redis.call('EXPIRE', KEYS[1], ttl)
    if cap > 0 and redis.call('ZADD', KEYS[2], 'XX', 'GT', 'CH', now + ttl, KEYS[1]) > 0 then
      if redis.call('TTL', KEYS[2]) < ttl then redis.call('EXPIRE', KEYS[2], ttl) end
    end
  end)
  if ok then return {raw, ''} end
  if type(err) == 'table' then err = err.err end
  return {raw, tostring(err)}
end
if cap > 0 then
  local live = redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf')
  local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf',
    'WITHSCORES', 'LIMIT', 0, 1)
  return {false, '', live, first[2] or false}
end
return {false, ''}
"""

# ARGV: JSON list of new messages, messages to keep (2 x max_turns), ttl_s,
# now, JSON list of turn ids, cap (0 = off). One atomic round trip:
# concurrent appends all land, in commit order. Unreadable stored history is
# replaced, not fatal. Returns the messages kept, or -1 when the session is
# new and its client holds `cap` live sessions already (nothing written).
APPEND_LUA = """
local ttl = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
local cap = tonumber(ARGV[6])
-- Reads first: the first write must be the HSET, which Redis refuses past
-- maxmemory (once a script wrote, Redis lets the rest of it write).
if cap > 0 and redis.call('EXISTS', KEYS[1]) == 0 then
  local counted = redis.call('ZSCORE', KEYS[2], KEYS[1])
  if (not counted or tonumber(counted) <= now)
      and redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf') >= cap then
    return -1
  end
end
local history = {}
local raw = redis.call('HGET', KEYS[1], 'history')
if raw then
  local ok, decoded = pcall(cjson.decode, raw)
  if ok and type(decoded) == 'table' then history = decoded end
end
-- Ids of the last turns stored: a turn whose save is retried lands once.
local ids = {}
local rawids = redis.call('HGET', KEYS[1], 'turn_ids')
if rawids then
  local ok, decoded = pcall(cjson.decode, rawids)
  if ok and type(decoded) == 'table' then ids = decoded end
end
local seen = {}
for _, v in ipairs(ids) do seen[v] = true end
local msgs = cjson.decode(ARGV[1])
for i, tid in ipairs(cjson.decode(ARGV[5])) do
  if tid == '' or not seen[tid] then
    history[#history + 1] = msgs[2 * i - 1]
    history[#history + 1] = msgs[2 * i]
    if tid ~= '' then ids[#ids + 1] = tid; seen[tid] = true end
  end
end
local keep = tonumber(ARGV[2])
local n = #history
if n > keep then
  local kept = {}
  for i = n - keep + 1, n do kept[#kept + 1] = history[i] end
  history = kept
end
if #ids > 64 then
  local recent = {}
  for i = #ids - 63, #ids do recent[#recent + 1] = ids[i] end
  ids = recent
end
local fields = {'history', cjson.encode(history), 'last_active', ARGV[4]}
if #ids > 0 then
  fields[#fields + 1] = 'turn_ids'
  fields[#fields + 1] = cjson.encode(ids)
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('EXPIRE', KEYS[1], ttl)
if cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  redis.call('ZADD', KEYS[2], now + ttl, KEYS[1])
  if redis.call('TTL', KEYS[2]) < ttl then redis.call('EXPIRE', KEYS[2], ttl) end
end
return #history
"""

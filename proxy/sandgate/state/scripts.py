"""The Lua scripts that count for the fleet: all the limit logic runs inside Redis.

Each script is one atomic step on the server (Redis runs a script to the end before any other
command), reads time from the server's own clock (`TIME`, or a key's TTL), and never leaves a
half-done change: a request that is refused changes nothing it would have spent. Python only
sends the arguments and reads the answer (EVALSHA, and the script's text again on NOSCRIPT:
redis-py's `Script` objects do that). No key outside KEYS is touched except the process leases
of CONN_ACQUIRE (so a single Redis, or a primary behind Sentinel; not Redis Cluster).

RATE (token bucket, one identity). KEYS[1] = the bucket (a hash: tokens, ts), ARGV = rate, burst.
    Refill by the time since `ts` at `rate` a second up to `burst`; take one token if there is a
    whole one. Answers "0" when granted, else the seconds until a token is there (as a string:
    Lua numbers become integers on the way out). The key expires once it would be full anyway.

BUDGET (several secrets, all or none). KEYS = one counter per secret (its window), ARGV =
    calls1, per_ms1, calls2, per_ms2, ...  First every counter is checked; if any is at its
    `calls`, nothing is counted and the answer is {index, ms until that window ends}. Else every
    counter is incremented, and a counter started by this call expires after its `per`: the
    window starts at the first call after the previous window ended. Answers {0, 0}.

SPEND_RESERVE (an LLM call's worst case, one budget). KEYS[1] = the window (a hash: w, i, o, c;
    ri, ro, rc the reservations in flight; id the identity that opened it; m:<model>:i|o|c the
    settled spend per model), ARGV = limits in, out, cost (-1: none), the amounts in, out, cost,
    per_ms, the identity. While every limited amount is under its limit (reservations in flight
    count), the amounts are added (to the spend and to what is in flight) and the answer is
    {0, window id}; else nothing changes and the answer is {1, ms until the window ends}. A
    window starts at its first call (its id: the server's time in µs then) and expires after
    `per`.

SPEND_SETTLE. KEYS[1] = the same hash, ARGV = the window id, the differences in, out, cost
    (spent minus reserved), the reserved in, out, cost, the model's name, and the spent in,
    out, cost. Applied only to the window reserved in (floored at 0): a window that ended has
    no debt. The reservation leaves what is in flight; the spend is added to its model's.

CONN_ACQUIRE (open connections of one identity). KEYS[1] = a hash process -> connections,
    ARGV = this process, the limit, the prefix of process lease keys.  The sum counts only
    processes whose lease key (`<prefix><process>`, refreshed by the process's heartbeat)
    still exists: a crashed process's connections stop counting once its lease expires, and its
    field is removed here. Under the limit: this process's field +1, answer 1; else 0.

CONN_RELEASE. KEYS[1] = the same hash, ARGV = this process. Its field -1 (removed at 0).
"""

from __future__ import annotations

RATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local held = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(held[1])
local ts = tonumber(held[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
  ts = now
end
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(ts))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""

BUDGET = """
for i = 1, #KEYS do
  local calls = tonumber(ARGV[2 * i - 1])
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used >= calls then
    local left = redis.call('PTTL', KEYS[i])
    if left < 0 then left = tonumber(ARGV[2 * i]) end
    return {i, left}
  end
end
for i = 1, #KEYS do
  if redis.call('INCR', KEYS[i]) == 1 then
    redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
  end
end
return {0, 0}
"""

SPEND_RESERVE = """
local w = redis.call('HGET', KEYS[1], 'w')
if w then
  local used = redis.call('HMGET', KEYS[1], 'i', 'o', 'c')
  for k = 1, 3 do
    local limit = tonumber(ARGV[k])
    if limit >= 0 and tonumber(used[k] or '0') >= limit then
      local left = redis.call('PTTL', KEYS[1])
      if left < 0 then left = tonumber(ARGV[7]) end
      return {1, left}
    end
  end
else
  local t = redis.call('TIME')
  w = t[1] .. string.format('%06d', tonumber(t[2]))
  redis.call('HSET', KEYS[1], 'w', w, 'i', 0, 'o', 0, 'c', 0, 'ri', 0, 'ro', 0, 'rc', 0,
             'id', ARGV[8] or '')
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
end
redis.call('HINCRBY', KEYS[1], 'i', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'o', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'c', ARGV[6])
redis.call('HINCRBY', KEYS[1], 'ri', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'ro', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'rc', ARGV[6])
return {0, w}
"""

SPEND_SETTLE = """
if redis.call('HGET', KEYS[1], 'w') ~= ARGV[1] then
  return 0
end
local names = {'i', 'o', 'c'}
for k = 1, 3 do
  local n = redis.call('HINCRBY', KEYS[1], names[k], ARGV[k + 1])
  if n < 0 then redis.call('HSET', KEYS[1], names[k], 0) end
  if ARGV[k + 4] then
    local r = redis.call('HINCRBY', KEYS[1], 'r' .. names[k], -tonumber(ARGV[k + 4]))
    if r < 0 then redis.call('HSET', KEYS[1], 'r' .. names[k], 0) end
    redis.call('HINCRBY', KEYS[1], 'm:' .. ARGV[8] .. ':' .. names[k], ARGV[k + 8])
  end
end
return 1
"""

CONN_ACQUIRE = """
local me = ARGV[1]
local limit = tonumber(ARGV[2])
local held = redis.call('HGETALL', KEYS[1])
local total = 0
for i = 1, #held, 2 do
  local proc = held[i]
  if proc == me or redis.call('EXISTS', ARGV[3] .. proc) == 1 then
    total = total + tonumber(held[i + 1])
  else
    redis.call('HDEL', KEYS[1], proc)
  end
end
if total >= limit then
  return 0
end
redis.call('HINCRBY', KEYS[1], me, 1)
return 1
"""

CONN_RELEASE = """
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if n <= 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return n
"""

# BEAT (every second, each process). KEYS[1] = the process's lease, KEYS[2] = the hash of
#   policy versions (process -> "version|expiry ms"), ARGV = process, version, lease ms.
#   Refreshes the lease, writes this process's version with its expiry on the server's clock,
#   removes the versions of processes whose expiry has passed, and answers the live ones as
#   {process, version, ...}.
BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[2], 'PX', ms)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. '|' .. tostring(now + ms))
local all = redis.call('HGETALL', KEYS[2])
local out = {}
for i = 1, #all, 2 do
  local v = all[i + 1]
  local sep = string.find(v, '|[^|]*$')
  local expires = sep and tonumber(string.sub(v, sep + 1)) or 0
  if expires < now then
    redis.call('HDEL', KEYS[2], all[i])
  else
    table.insert(out, all[i])
    table.insert(out, string.sub(v, 1, sep - 1))
  end
end
return out
"""

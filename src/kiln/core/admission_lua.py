"""The Redis Functions library behind RedisAdmission: one atomic function per decision.

Versioned names (library `kiln_admission_v1`, functions `kiln_v1_*`): a gateway
of the next version loads `kiln_admission_v2` beside this one, so old and new
gateways run side by side during a rolling upgrade on the same keys. Change the
key layout only together with a new version and a documented migration.

Time comes from the Redis server (TIME) plus the test clock's offset (0 outside
tests). Money is integer nanodollars; Lua's numbers are doubles, exact up to
2^53 nanodollars (about 9 million USD): larger balances are capped there, which
can only refuse, never overspend. Keys, under the prefix P:

    P:alive            time the state was (re)built from the database
    P:o:<org>          hash: epoch, pgc/pgv (committed credits, version), pend (settled cost
                       not yet committed), res (reserved), month, mspend, tok
    P:k:<key>          hash: reset, period, pspend, res, tok
    P:os:<org> P:ks:<key>   zsets of the tickets in flight (score: lease expiry, whole seconds)
    P:or:<org> P:kr:<key>   lists of request times (the last minute)
    P:ot:<org> P:kt:<key>   lists of "time:tokens" (the last minute)
    P:oc:<org>         list of count_tokens times
    P:t:<gen>          hash: a ticket (org, key, proj, model, ep, res, deliv, epoch)
    P:leases           zset of every ticket's lease expiry (whole seconds)
    P:pend, P:pendt    settled cost per generation until its event is committed (and when, whole seconds)
    P:lost, P:lostq    tickets whose lease expired, to bill as `lost` (and when claimable)
"""

LIBRARY = r"""#!lua name=kiln_admission_v1

local MAXN = 9007199254740991  -- 2^53 - 1
local GRACE = 3                 -- seconds after a rebuild: every live request re-registers first

local function int(x) return string.format('%d', x) end
local function num(x) return tonumber(x) or 0 end

local function now_s(offset)
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6 + offset
end

-- A lease's expiry in whole seconds, rounded up (at most a second longer than the TTL). Sorted
-- sets of up to 128 members are listpacks, which store a score as an integer when it is one: a
-- ZADD then compares integers while it looks for its place, instead of parsing every other
-- member's score from its text (6.5 against 1.9 µs a ZADD at 64 tickets in flight).
local function lease_end(now, ttl)
  return math.ceil(now + tonumber(ttl))
end

-- Civil date of a day number (days since 1970-01-01), H. Hinnant's algorithm.
local function ymd(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function month_id(now)
  local y, m = ymd(math.floor(now / 86400))
  return string.format('%04d-%02d', y, m)
end

-- The key spend period a time falls in; the same periods as kiln.core.accounts.period_of.
local function period_id(reset, now)
  if reset == 'never' then return '' end
  if reset == 'monthly' then return month_id(now) end
  local days = math.floor(now / 86400)
  if reset == 'daily' then return 'd' .. days end
  return 'w' .. math.floor((days + 3) / 7)  -- ISO weeks start on Monday; day 0 was a Thursday
end

-- New month, new key period: their spend starts again at 0.
local function roll(P, org, key, now)
  local ok = P .. ':o:' .. org
  local month = month_id(now)
  if redis.call('HGET', ok, 'month') ~= month then
    redis.call('HSET', ok, 'month', month, 'mspend', 0)
  end
  if key then
    local kk = P .. ':k:' .. key
    local reset = redis.call('HGET', kk, 'reset')
    if reset and reset ~= 'never' then
      local period = period_id(reset, now)
      if redis.call('HGET', kk, 'period') ~= period then
        redis.call('HSET', kk, 'period', period, 'pspend', 0)
      end
    end
  end
end

-- Money left after reservations and the limit that binds (ties as in MemoryAdmission).
local function available(P, org, key, budget, klimit)
  local o = redis.call('HMGET', P .. ':o:' .. org, 'pgc', 'pend', 'res', 'mspend')
  local res = num(o[3])
  local best, scope = num(o[1]) - num(o[2]) - res, 'credits'
  if budget >= 0 then
    local left = budget - num(o[4]) - res
    if left < best or (left == best and 'budget' < scope) then best, scope = left, 'budget' end
  end
  if key and klimit >= 0 then
    local k = redis.call('HMGET', P .. ':k:' .. key, 'pspend', 'res')
    local left = klimit - num(k[1]) - num(k[2])
    if left < best or (left == best and 'key' < scope) then best, scope = left, 'key' end
  end
  return best, scope
end

local function affordable(nano, price)
  if nano <= 0 then return 0 end
  if price <= 0 then return MAXN end
  local n = math.floor(nano / price)
  while n > 0 and math.ceil(n * price) > nano do n = n - 1 end
  return n
end

-- A settled cost: against the month and key period now, against credits until committed.
local function charge(P, org, key, gen, cost, now)
  if cost <= 0 then return end
  local ok = P .. ':o:' .. org
  redis.call('HINCRBY', ok, 'pend', int(cost))
  redis.call('HINCRBY', ok, 'mspend', int(cost))
  redis.call('HINCRBY', P .. ':k:' .. key, 'pspend', int(cost))
  redis.call('HSET', P .. ':pend', gen, org .. '|' .. key .. '|' .. int(cost))
  redis.call('ZADD', P .. ':pendt', math.floor(now), gen)
end

local function trim(list, now)
  while true do
    local first = redis.call('LINDEX', list, 0)
    if not first or tonumber(first) > now - 60 then return end
    redis.call('LPOP', list)
  end
end

local function trim_tokens(list, hash, now)
  while true do
    local first = redis.call('LINDEX', list, 0)
    if not first then return end
    local sep = string.find(first, ':', 1, true)
    if tonumber(string.sub(first, 1, sep - 1)) > now - 60 then return end
    redis.call('LPOP', list)
    redis.call('HINCRBY', hash, 'tok', -tonumber(string.sub(first, sep + 1)))
  end
end

local function reset_in(list, now)
  local first = redis.call('LINDEX', list, 0)
  if not first then return 0 end
  local sep = string.find(first, ':', 1, true)
  local t = tonumber(sep and string.sub(first, 1, sep - 1) or first)
  return math.max(1, math.ceil(t + 60 - now))
end

-- A ticket whose lease expired: free its slot and reservation, charge what it had delivered,
-- and queue it to be billed as a `lost` usage event.
local function reap(P, gen, now)
  redis.call('ZREM', P .. ':leases', gen)
  local tk = P .. ':t:' .. gen
  local t = redis.call('HMGET', tk, 'org', 'key', 'proj', 'model', 'ep', 'res', 'deliv')
  if not t[1] then return end
  local org, key = t[1], t[2]
  redis.call('ZREM', P .. ':os:' .. org, gen)
  redis.call('ZREM', P .. ':ks:' .. key, gen)
  redis.call('HINCRBY', P .. ':o:' .. org, 'res', -num(t[6]))
  redis.call('HINCRBY', P .. ':k:' .. key, 'res', -num(t[6]))
  roll(P, org, key, now)
  charge(P, org, key, gen, num(t[7]), now)
  redis.call('HSET', P .. ':lost', gen, table.concat({org, key, t[3], t[4], t[5], int(num(t[7]))}, '|'))
  redis.call('ZADD', P .. ':lostq', 0, gen)
  redis.call('DEL', tk)
end

local function reap_expired(P, slots, now)
  for _, gen in ipairs(redis.call('ZRANGEBYSCORE', slots, '-inf', now)) do reap(P, gen, now) end
end

-- Rate checks for one holder (org or key); nil when it may go on, else the refusal.
local function check_rates(P, who, slots, rq, tk, hash, conc, rpm, tpm, now)
  if conc >= 0 and redis.call('ZCARD', slots) >= conc then return {'conc', who} end
  trim(rq, now)
  trim_tokens(tk, hash, now)
  local used_rq = redis.call('LLEN', rq)
  local used_tok = num(redis.call('HGET', hash, 'tok'))
  if rpm >= 0 and used_rq >= rpm then return {'rate', who, 'requests', used_rq, used_tok, reset_in(rq, now)} end
  if tpm >= 0 and used_tok >= tpm then return {'rate', who, 'tokens', used_rq, used_tok, reset_in(tk, now)} end
  return nil
end

local function loaded(P, org, key, reset, now)
  local ok = P .. ':o:' .. org
  if redis.call('HEXISTS', ok, 'epoch') == 0 then return false end
  if key and redis.call('HGET', P .. ':k:' .. key, 'reset') ~= reset then return false end
  return true
end

-- admit: args offset, org, key, gen, proj, model, ep, kind, conc, rpm, tpm, budget,
--        kconc, krpm, ktpm, klimit, kreset, prompt_nano, price, want, outputs, stream, count_rpm, ttl
-- (-1: no such limit). Returns {'ok', output_tokens, reserved, capped, epoch} or a refusal.
local function admit(keys, a)
  local P = keys[1]
  local now = now_s(tonumber(a[1]))
  local org, key, gen = a[2], a[3], a[4]
  if a[8] == 'count' then
    local list = P .. ':oc:' .. org
    trim(list, now)
    if redis.call('LLEN', list) >= tonumber(a[23]) then return {'count', reset_in(list, now)} end
    redis.call('RPUSH', list, now)
    redis.call('EXPIRE', list, 120)
    return {'ok', 0, 0, 0, ''}
  end
  local kreset = a[17]
  if not loaded(P, org, key, kreset, now) then return {'load', tostring(now)} end
  local alive = tonumber(redis.call('GET', P .. ':alive') or '0')
  if now - alive < GRACE then return {'rebuilding', math.ceil(alive + GRACE - now)} end
  roll(P, org, key, now)
  local budget, klimit = tonumber(a[12]), tonumber(a[16])
  local money, scope = available(P, org, key, budget, klimit)
  local prompt = tonumber(a[18])
  if money <= prompt then return {'pay', scope, money <= 0 and 1 or 0} end
  local os_, ks = P .. ':os:' .. org, P .. ':ks:' .. key
  reap_expired(P, os_, now)
  reap_expired(P, ks, now)
  local ok, kk = P .. ':o:' .. org, P .. ':k:' .. key
  local refusal = check_rates(P, 'organisation', os_, P .. ':or:' .. org, P .. ':ot:' .. org, ok,
                              tonumber(a[9]), tonumber(a[10]), tonumber(a[11]), now)
    or check_rates(P, 'key', ks, P .. ':kr:' .. key, P .. ':kt:' .. key, kk,
                   tonumber(a[13]), tonumber(a[14]), tonumber(a[15]), now)
  if refusal then return refusal end
  local price, want, outputs, stream = tonumber(a[19]), tonumber(a[20]), tonumber(a[21]), a[22] == '1'
  local output = math.min(want, affordable(money - prompt, price))
  if want >= 1 and output < outputs then return {'pay', scope, 0} end
  local capped = 0
  if not stream and output < want then
    output = output - output % outputs
    capped = 1
  end
  local reserved = prompt + math.ceil(output * price)
  local expiry = lease_end(now, a[24])
  redis.call('HINCRBY', ok, 'res', int(reserved))
  redis.call('HINCRBY', kk, 'res', int(reserved))
  redis.call('ZADD', os_, expiry, gen)
  redis.call('ZADD', ks, expiry, gen)
  redis.call('ZADD', P .. ':leases', expiry, gen)
  redis.call('RPUSH', P .. ':or:' .. org, now)
  redis.call('RPUSH', P .. ':kr:' .. key, now)
  local epoch = redis.call('HGET', ok, 'epoch')
  redis.call('HSET', P .. ':t:' .. gen, 'org', org, 'key', key, 'proj', a[5], 'model', a[6], 'ep', a[7],
             'res', int(reserved), 'deliv', 0, 'epoch', epoch)
  return {'ok', output, int(reserved), capped, epoch}
end

-- extend: args offset, gen, tokens, price, delivered, budget, klimit, ttl. Returns tokens granted.
local function extend(keys, a)
  local P = keys[1]
  local now = now_s(tonumber(a[1]))
  local gen = a[2]
  local tk = P .. ':t:' .. gen
  local t = redis.call('HMGET', tk, 'org', 'key')
  if not t[1] then return 0 end
  local org, key = t[1], t[2]
  redis.call('HSET', tk, 'deliv', a[5])
  local expiry = lease_end(now, a[8])
  redis.call('ZADD', P .. ':leases', 'XX', expiry, gen)
  redis.call('ZADD', P .. ':os:' .. org, 'XX', expiry, gen)
  redis.call('ZADD', P .. ':ks:' .. key, 'XX', expiry, gen)
  roll(P, org, key, now)
  local money = available(P, org, key, tonumber(a[6]), tonumber(a[7]))
  local price = tonumber(a[4])
  local granted = math.min(tonumber(a[3]), affordable(money, price))
  if granted > 0 then
    local nano = int(math.ceil(granted * price))
    redis.call('HINCRBY', P .. ':o:' .. org, 'res', nano)
    redis.call('HINCRBY', P .. ':k:' .. key, 'res', nano)
    redis.call('HINCRBY', tk, 'res', nano)
  end
  return granted
end

-- settle: args offset, gen, cost, tokens. Returns 1, or 0 when the ticket is gone (reaped, rebuilt).
local function settle(keys, a)
  local P = keys[1]
  local now = now_s(tonumber(a[1]))
  local gen = a[2]
  local tk = P .. ':t:' .. gen
  local t = redis.call('HMGET', tk, 'org', 'key', 'res')
  if not t[1] then return 0 end
  local org, key = t[1], t[2]
  local ok, kk = P .. ':o:' .. org, P .. ':k:' .. key
  redis.call('ZREM', P .. ':leases', gen)
  redis.call('ZREM', P .. ':os:' .. org, gen)
  redis.call('ZREM', P .. ':ks:' .. key, gen)
  redis.call('HINCRBY', ok, 'res', -num(t[3]))
  redis.call('HINCRBY', kk, 'res', -num(t[3]))
  redis.call('DEL', tk)
  roll(P, org, key, now)
  charge(P, org, key, gen, tonumber(a[3]), now)
  local tokens = tonumber(a[4])
  if tokens > 0 then
    local entry = tostring(now) .. ':' .. a[4]
    redis.call('RPUSH', P .. ':ot:' .. org, entry)
    redis.call('HINCRBY', ok, 'tok', tokens)
    redis.call('RPUSH', P .. ':kt:' .. key, entry)
    redis.call('HINCRBY', kk, 'tok', tokens)
  end
  return 1
end

-- load: args offset, org, key, epoch, credits, version, month_spend, reset, key_spend, rebuild.
-- Sets what is missing only: another gateway may have loaded it a moment ago. `rebuild` 1:
-- the loading gateway had seen this state before, so Redis lost it: new admissions wait GRACE
-- seconds, while every gateway re-registers the requests it still serves.
local function load(keys, a)
  local P = keys[1]
  local now = now_s(tonumber(a[1]))
  local org, key = a[2], a[3]
  local ok, kk = P .. ':o:' .. org, P .. ':k:' .. key
  redis.call('SET', P .. ':alive', tostring(a[10] == '1' and now or now - GRACE), 'NX')
  if redis.call('HEXISTS', ok, 'epoch') == 0 then
    redis.call('HSET', ok, 'epoch', a[4], 'pgc', int(math.min(tonumber(a[5]), MAXN)), 'pgv', a[6],
               'month', month_id(now), 'mspend', a[7])
  end
  if redis.call('HGET', kk, 'reset') ~= a[8] then
    redis.call('HSET', kk, 'reset', a[8], 'period', period_id(a[8], now), 'pspend', a[9])
  end
  return redis.call('HGET', ok, 'epoch')
end

-- renew: args offset, ttl, then per ticket: gen, org, key, proj, model, ep, res, deliv, epoch.
-- Extends live leases; re-registers tickets lost with a rebuilt state (the org's epoch moved on).
-- Returns, per ticket, its epoch now, or '' when its org is not loaded yet or it was reaped.
local function renew(keys, a)
  local P = keys[1]
  local now = now_s(tonumber(a[1]))
  local expiry = lease_end(now, a[2])
  local out = {}
  for i = 3, #a, 9 do
    local gen, org, key = a[i], a[i + 1], a[i + 2]
    local epoch = redis.call('HGET', P .. ':o:' .. org, 'epoch')
    local tk = P .. ':t:' .. gen
    if redis.call('EXISTS', tk) == 1 then
      redis.call('ZADD', P .. ':leases', 'XX', expiry, gen)
      redis.call('ZADD', P .. ':os:' .. org, 'XX', expiry, gen)
      redis.call('ZADD', P .. ':ks:' .. key, 'XX', expiry, gen)
      out[#out + 1] = epoch or ''
    elseif epoch and epoch ~= a[i + 8] and redis.call('HEXISTS', P .. ':lost', gen) == 0
        and redis.call('HEXISTS', P .. ':k:' .. key, 'reset') == 1 then
      redis.call('HSET', tk, 'org', org, 'key', key, 'proj', a[i + 3], 'model', a[i + 4], 'ep', a[i + 5],
                 'res', a[i + 6], 'deliv', a[i + 7], 'epoch', epoch)
      redis.call('HINCRBY', P .. ':o:' .. org, 'res', a[i + 6])
      redis.call('HINCRBY', P .. ':k:' .. key, 'res', a[i + 6])
      redis.call('ZADD', P .. ':os:' .. org, expiry, gen)
      redis.call('ZADD', P .. ':ks:' .. key, expiry, gen)
      redis.call('ZADD', P .. ':leases', expiry, gen)
      out[#out + 1] = epoch
    else
      out[#out + 1] = ''
    end
  end
  return out
end

-- sweep: args offset, limit. Reaps expired leases; claims lost tickets to bill (a claim
-- lasts 30 s: if its gateway dies before the event is committed, another one bills it).
local function sweep(keys, a)
  local P = keys[1]
  local now = now_s(tonumber(a[1]))
  local limit = tonumber(a[2])
  for _, gen in ipairs(redis.call('ZRANGEBYSCORE', P .. ':leases', '-inf', now, 'LIMIT', 0, limit)) do
    reap(P, gen, now)
  end
  local out = {}
  for _, gen in ipairs(redis.call('ZRANGEBYSCORE', P .. ':lostq', '-inf', now, 'LIMIT', 0, limit)) do
    local entry = redis.call('HGET', P .. ':lost', gen)
    if entry then
      redis.call('ZADD', P .. ':lostq', now + 30, gen)
      out[#out + 1] = gen .. '|' .. entry
    else
      redis.call('ZREM', P .. ':lostq', gen)
    end
  end
  -- Settled costs whose commit was never acknowledged (a gateway died): by now the database
  -- has them or never will; the credits re-read from it are the truth either way.
  for _, gen in ipairs(redis.call('ZRANGEBYSCORE', P .. ':pendt', '-inf', now - 600, 'LIMIT', 0, limit)) do
    local entry = redis.call('HGET', P .. ':pend', gen)
    if entry then
      local org, _, cost = string.match(entry, '([^|]*)|([^|]*)|([^|]*)')
      redis.call('HINCRBY', P .. ':o:' .. org, 'pend', -tonumber(cost))
      redis.call('HDEL', P .. ':pend', gen)
    end
    redis.call('ZREM', P .. ':pendt', gen)
  end
  return out
end

-- lost_done: args gen...: their `lost` events are committed.
local function lost_done(keys, a)
  local P = keys[1]
  for _, gen in ipairs(a) do
    redis.call('HDEL', P .. ':lost', gen)
    redis.call('ZREM', P .. ':lostq', gen)
  end
  return #a
end

-- committed: args n, gen x n, then (org, credits, version)...: events are in the database.
-- Their cost leaves `pend`; a newer committed balance replaces the one kept here.
local function committed(keys, a)
  local P = keys[1]
  local n = tonumber(a[1])
  for i = 2, n + 1 do
    local entry = redis.call('HGET', P .. ':pend', a[i])
    if entry then
      local org, _, cost = string.match(entry, '([^|]*)|([^|]*)|([^|]*)')
      redis.call('HINCRBY', P .. ':o:' .. org, 'pend', -tonumber(cost))
      redis.call('HDEL', P .. ':pend', a[i])
      redis.call('ZREM', P .. ':pendt', a[i])
    end
  end
  for i = n + 2, #a, 3 do
    local ok = P .. ':o:' .. a[i]
    if redis.call('HEXISTS', ok, 'epoch') == 1 and num(redis.call('HGET', ok, 'pgv')) < tonumber(a[i + 2]) then
      redis.call('HSET', ok, 'pgc', int(math.min(tonumber(a[i + 1]), MAXN)), 'pgv', a[i + 2])
    end
  end
  return 1
end

-- state: args offset, org, key ('' for none), budget, klimit, rpm, tpm.
-- Returns {loaded, spendable, scope, requests used, requests reset, tokens used, tokens reset, in flight}.
local function state(keys, a)
  local P = keys[1]
  local now = now_s(tonumber(a[1]))
  local org = a[2]
  local key = a[3] ~= '' and a[3] or nil
  if redis.call('HEXISTS', P .. ':o:' .. org, 'epoch') == 0 then return {0} end
  if key and redis.call('HEXISTS', P .. ':k:' .. key, 'reset') == 0 then return {0} end
  roll(P, org, key, now)
  reap_expired(P, P .. ':os:' .. org, now)
  local money, scope = available(P, org, key, tonumber(a[4]), tonumber(a[5]))
  local rq, tk, ok = P .. ':or:' .. org, P .. ':ot:' .. org, P .. ':o:' .. org
  trim(rq, now)
  trim_tokens(tk, ok, now)
  return {1, int(math.max(money, 0)), scope, redis.call('LLEN', rq), reset_in(rq, now),
          num(redis.call('HGET', ok, 'tok')), reset_in(tk, now), redis.call('ZCARD', P .. ':os:' .. org)}
end

redis.register_function('kiln_v1_admit', admit)
redis.register_function('kiln_v1_extend', extend)
redis.register_function('kiln_v1_settle', settle)
redis.register_function('kiln_v1_load', load)
redis.register_function('kiln_v1_renew', renew)
redis.register_function('kiln_v1_sweep', sweep)
redis.register_function('kiln_v1_lost_done', lost_done)
redis.register_function('kiln_v1_committed', committed)
redis.register_function('kiln_v1_state', state)
"""

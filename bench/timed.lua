-- wrk script for bench/tail.py: POST one JSON body and record, for every request, when it was
-- sent and how long its answer took (LuaJIT's FFI reads CLOCK_MONOTONIC; wrk's own histogram
-- keeps no times). Lines "start_us latency_us" are appended to BENCH_OUT every 500 requests
-- (wrk's done() runs in another Lua state and cannot see this thread's table).
--   BENCH_POST_LUA (bench/post.lua, which reads BENCH_REQUESTS and BENCH_HEADERS), BENCH_OUT
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } kiln_timespec;
int clock_gettime(int clk, kiln_timespec *tp);
]]
local ts = ffi.new("kiln_timespec")
local function now_us()
  ffi.C.clock_gettime(1, ts)  -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end

dofile(os.getenv("BENCH_POST_LUA"))  -- bench/post.lua: the request and headers, as bench/run.py sends them
done = nil  -- its summary line is not needed here

local prepared, sent = nil, 0
local lines = {}

request = function()
  if prepared == nil then prepared = wrk.format() end
  sent = now_us()
  return prepared
end

response = function(status, headers, body)
  lines[#lines + 1] = string.format("%.1f %.1f", sent, now_us() - sent)
  if #lines >= 500 then
    local f = assert(io.open(os.getenv("BENCH_OUT"), "a"))
    f:write(table.concat(lines, "\n"), "\n")
    f:close()
    lines = {}
  end
end

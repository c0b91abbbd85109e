-- wrk script for bench/tail.py: POST one JSON body and record, for every request, when it was
-- sent and how long its answer took (LuaJIT's FFI reads CLOCK_MONOTONIC; wrk's own histogram
-- keeps no times). Lines "start_us latency_us" are appended to BENCH_OUT every 500 requests
-- (wrk's done() runs in another Lua state and cannot see this thread's table).
--   BENCH_PATH, BENCH_BODY (a file), BENCH_HEADERS ("Name: value" lines), BENCH_OUT
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

local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local data = f:read("*a")
  f:close()
  return data
end

wrk.method = "POST"
wrk.path = os.getenv("BENCH_PATH")
wrk.body = slurp(os.getenv("BENCH_BODY"))
wrk.headers["Content-Type"] = "application/json"
for name, value in string.gmatch(os.getenv("BENCH_HEADERS") or "", "([^:\n]+):%s*([^\n]*)") do
  wrk.headers[name] = value
end

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

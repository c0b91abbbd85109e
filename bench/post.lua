-- wrk script for bench/: POST JSON bodies and print one machine-readable summary line at the end.
--   BENCH_REQUESTS  a file of "PATH<TAB>BODY_FILE" lines; one line: every request is the same
--                   (wrk's pre-built request, cheapest); several: requests cycle through them
--   BENCH_HEADERS   extra headers, "Name: value" lines
-- Summary: BENCH requests duration_us non2xx connect_err read_err write_err timeouts p50_us p99_us
local function slurp(path)
  local f = assert(io.open(path, "rb"))
  local data = f:read("*a")
  f:close()
  return data
end

wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
for name, value in string.gmatch(os.getenv("BENCH_HEADERS") or "", "([^:\n]+):%s*([^\n]*)") do
  wrk.headers[name] = value
end

local entries = {}
for line in string.gmatch(slurp(os.getenv("BENCH_REQUESTS")), "[^\n]+") do
  local path, file = string.match(line, "^([^\t]+)\t(.+)$")
  entries[#entries + 1] = {path = path, body = slurp(file)}
end

if #entries == 1 then
  wrk.path = entries[1].path
  wrk.body = entries[1].body
else
  local prepared, i = {}, 0
  for k, e in ipairs(entries) do
    prepared[k] = wrk.format("POST", e.path, nil, e.body)
  end
  request = function()
    i = i % #prepared + 1
    return prepared[i]
  end
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH %d %d %d %d %d %d %d %d %d\n", summary.requests, summary.duration,
    e.status, e.connect, e.read, e.write, e.timeout, latency:percentile(50), latency:percentile(99)))
end

-- wrk script for bench/run.py: POST the JSON body in $BENCH_BODY (with $BENCH_KEY as a
-- Bearer token when set) and print one machine-readable summary line at the end:
-- BENCH requests duration_us non2xx connect_err read_err write_err timeouts p50_us p99_us
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("BENCH_BODY")
local key = os.getenv("BENCH_KEY")
if key and key ~= "" then
  wrk.headers["Authorization"] = "Bearer " .. key
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH %d %d %d %d %d %d %d %d %d\n", summary.requests, summary.duration,
    e.status, e.connect, e.read, e.write, e.timeout, latency:percentile(50), latency:percentile(99)))
end

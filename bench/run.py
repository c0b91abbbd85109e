"""Kiln load benchmark: the model-server simulator called directly vs through Kiln.

One run starts `kiln sim` (zero delays) and a real `kiln serve` in front of it,
creates an org/project/key through the admin API, drives load with wrk (or an
asyncio+aiohttp client when wrk is missing) at several concurrencies, checks the
through-Kiln responses and the usage ledger, and prints one markdown table.

    .venv/bin/python bench/run.py [--duration 5] [--quick] [--concurrency 1,8,64]   (see bench/README.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

PY = sys.executable
MODEL = "bench-model"
ADMIN_KEY = "sk-kiln-admin-bench-" + "b" * 32
MESSAGES = [{"role": "user", "content": "Say hello to the benchmark in a few words."}]
WORKLOADS: dict[str, dict[str, Any]] = {
    "non-stream": {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "sim": {"reply_tokens": 16}},
    # 20 content chunks: the reply would be 40 tokens, max_tokens cuts it at 20.
    "stream": {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 20, "sim": {"reply_tokens": 40}},
}
TARGET_RPS = 1500.0  # non-stream, c=64, through Kiln, one gateway worker
TARGET_ADDED_P50_MS = 1.0  # non-stream, c=1
WRK_SCRIPT = Path(__file__).with_name("post.lua")


class BenchError(RuntimeError):
    """A failed check: the benchmark's numbers cannot be trusted."""


@dataclass
class Result:
    requests: int  # completed requests
    seconds: float
    errors: int  # non-2xx responses + socket errors + timeouts
    p50_ms: float
    p99_ms: float
    gateway_cpu_us: float = 0.0  # gateway CPU time (user + system) per request, through Kiln only

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


Row = tuple[str, int, Result, Result]  # workload, concurrency, direct, through Kiln


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cmd: list[str], cpu: int | None) -> list[str]:
    """Prefix `cmd` with `taskset -c CPU` when pinning."""
    return cmd if cpu is None else ["taskset", "-c", str(cpu), *cmd]


def spawn(stack: ExitStack, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a process whose output goes to `log`; it is stopped when `stack` closes."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    stack.callback(stop, proc)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s (a no-op for a process that already exited)."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_until(check: Any, proc: subprocess.Popen[bytes], log: Path, what: str, timeout: float = 30) -> Any:
    """Poll `check()` until it returns something truthy; fail if `proc` dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        if found := check():
            return found
        time.sleep(0.05)
    raise BenchError(f"{what} did not start within {timeout:.0f} s:\n{log.read_text(errors='replace')}")


def start_sim(stack: ExitStack, tmp: Path, cpu: int | None) -> tuple[str, subprocess.Popen[bytes]]:
    """`kiln sim` with zero delays; returns its base URL."""
    log = tmp / "sim.log"
    proc = spawn(stack, pinned([PY, "-m", "kiln.sim", "--port", "0", "--model", MODEL], cpu), log)

    def listening() -> str | None:  # "kiln sim listening on http://127.0.0.1:PORT"
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "listening on" in ln]
        return lines[0].rsplit(" ", 1)[-1] if lines else None

    return wait_until(listening, proc, log, "kiln sim"), proc


def start_gateway(stack: ExitStack, tmp: Path, sim_url: str, cpu: int | None) -> tuple[str, subprocess.Popen[bytes]]:
    """`kiln serve` with one model backed by the simulator; returns its base URL."""
    config = tmp / "kiln.toml"
    config.write_text(f"""
[limits]
rpm = 100000000
concurrency = 100000

[[models]]
id = "{MODEL}"
context_window = 32768
max_output_tokens = 8192
prices = {{ input = "0.10", output = "0.30" }}
[[models.backends]]
url = "{sim_url}/v1"
""")
    port, log = free_port(), tmp / "gateway.log"
    cmd = [PY, "-m", "kiln", "serve", "--config", str(config), "--port", str(port), "--data-dir", str(tmp / "data")]
    proc = spawn(stack, pinned(cmd, cpu), log, env={**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY})
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return http("GET", url + "/health")[0] == 200
        except OSError:
            return False

    wait_until(healthy, proc, log, "kiln serve")
    return url, proc


def peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set size) of a live process, in MiB."""
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One blocking request; returns (status, lower-cased headers, body) for any status."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        resp = urllib.request.urlopen(req, timeout=30)
    except urllib.error.HTTPError as exc:
        resp = exc
    with resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()


def admin(gw: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
    status, _, raw = http(method, f"{gw}/admin/v1{path}", body, ADMIN_KEY)
    if status not in (200, 201):
        raise BenchError(f"admin {method} {path}: HTTP {status}: {raw!r}")
    return dict(json.loads(raw))


def create_tenant(gw: str) -> tuple[str, str]:
    """An org with large credits, a project and a key; returns (org_id, key)."""
    org = admin(gw, "POST", "/orgs", {"name": f"bench-{os.getpid()}", "credits": "1000000"})
    project = admin(gw, "POST", "/projects", {"org_id": org["id"], "name": "bench"})
    key = admin(gw, "POST", "/keys", {"project_id": project["id"], "name": "bench"})
    return org["id"], key["key"]


def check_responses(gw: str, key: str) -> None:
    """One request per workload through Kiln: 200, generation id, cost, and 20 stream chunks."""
    for name, body in WORKLOADS.items():
        status, headers, raw = http("POST", gw + "/v1/chat/completions", body, key)
        if status != 200 or "x-neocloud-generation-id" not in headers:
            raise BenchError(f"{name} through Kiln: HTTP {status}: {raw[:500]!r}")
        if body.get("stream"):
            events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
            chunks = sum(1 for e in events for c in e.get("choices", []) if c.get("delta", {}).get("content"))
            if chunks != 20:
                raise BenchError(f"stream through Kiln: expected 20 content chunks, got {chunks}")
        elif "cost" not in json.loads(raw).get("usage", {}):
            raise BenchError(f"non-stream through Kiln: no usage.cost in {raw[:500]!r}")


def ensure_wrk() -> str | None:
    """Path of wrk, installing it with apt-get if possible; None when unavailable."""
    if shutil.which("wrk") is None and shutil.which("apt-get") and os.geteuid() == 0:
        print("wrk not found; trying `apt-get install -y wrk` ...", flush=True)
        subprocess.run(["apt-get", "install", "-y", "wrk"], capture_output=True, check=False)
    return shutil.which("wrk")


def run_wrk(url: str, body: dict[str, Any], key: str | None, conc: int, seconds: float, cpu: int | None) -> Result:
    """wrk, one thread, `conc` connections; the numbers come from post.lua's `done` hook."""
    secs = max(1, round(seconds))  # wrk takes whole seconds
    cmd = pinned(["wrk", "-t1", f"-c{conc}", f"-d{secs}s", "--timeout", "10s", "-s", str(WRK_SCRIPT), url], cpu)
    env = {**os.environ, "BENCH_BODY": json.dumps(body), "BENCH_KEY": key or ""}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({out.returncode}): {out.stdout}{out.stderr}")
    n, usec, status, *sock, p50, p99 = (int(x) for x in line.split()[1:])
    return Result(n, usec / 1e6, status + sum(sock), p50 / 1000, p99 / 1000)


def run_aiohttp(url: str, body: dict[str, Any], key: str | None, conc: int, seconds: float, cpu: int | None) -> Result:
    """In-process asyncio+aiohttp client (the fallback; it may be the bottleneck at high c)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    return asyncio.run(_aiohttp_load(url, body, key, conc, seconds))


async def _aiohttp_load(url: str, body: dict[str, Any], key: str | None, conc: int, seconds: float) -> Result:
    import aiohttp

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode()
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        end = start + seconds

        async def worker() -> None:
            nonlocal errors
            while (t0 := time.perf_counter()) < end:
                try:
                    async with session.post(url, data=data, headers=headers) as resp:
                        await resp.read()
                        errors += resp.status >= 400
                except aiohttp.ClientError:
                    errors += 1
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(conc)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return Result(len(latencies), elapsed, errors, percentile_ms(latencies, 0.50), percentile_ms(latencies, 0.99))


def percentile_ms(ordered: list[float], q: float) -> float:
    """The q-quantile (0..1) of sorted latencies in seconds, in ms."""
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000 if ordered else 0.0


def cpus_for(no_pin: bool) -> tuple[int | None, int | None, str]:
    """(gateway CPU, simulator+load CPU, description)."""
    cpus = sorted(os.sched_getaffinity(0))
    if no_pin or len(cpus) < 2 or shutil.which("taskset") is None:
        why = "--no-pin" if no_pin else "taskset missing" if len(cpus) >= 2 else "fewer than 2 CPUs"
        return None, None, f"no CPU pinning ({why}); all processes share {len(cpus)} CPU(s)"
    return cpus[0], cpus[1], f"gateway on CPU {cpus[0]}, simulator and load generator on CPU {cpus[1]} (taskset)"


def measure(a: argparse.Namespace, load: Any, urls: tuple[str, str], key: str, cpu: int | None,
            gw_pid: int) -> tuple[list[Row], int, int]:
    """Every (workload, c) cell, direct then through Kiln, each after a warm-up.

    Returns the rows, the requests Kiln completed (warm-ups included) and the
    slack for the ledger check: requests cut off when a run ends may be metered too.
    """
    rows: list[Row] = []
    sent, slack = 0, 0
    for name in a.workloads:
        for c in a.levels:
            results = []
            for base, token in ((urls[0], None), (urls[1], key)):
                url, where = base + "/v1/chat/completions", "through Kiln" if token else "direct"
                run = partial(load, url, WORKLOADS[name], token, c)
                warm = run(a.warmup, cpu) if a.warmup > 0 else None
                cpu_before = cpu_seconds(gw_pid)
                res = run(a.duration, cpu)
                res.gateway_cpu_us = (cpu_seconds(gw_pid) - cpu_before) * 1e6 / max(res.requests, 1)
                for r in (warm, res):
                    if r and r.errors:
                        raise BenchError(f"{name} c={c} {where}: {r.errors} failed requests (non-2xx or socket)")
                    if r and token:
                        sent, slack = sent + r.requests, slack + c
                results.append(res)
            rows.append((name, c, results[0], results[1]))
            print(f"  {name:10} c={c:<3} direct {results[0].rps:7,.0f}, Kiln {results[1].rps:7,.0f} rps", flush=True)
    return rows, sent, slack


def fmt_table(rows: list[Row]) -> str:
    head = ("| workload | c | direct rps | direct p50 ms | direct p99 ms | Kiln rps | Kiln p50 ms | Kiln p99 ms "
            "| Kiln/direct rps | added p50 ms | Kiln CPU µs/req |")
    lines = [head, "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, c, d, k in rows:
        lines.append(f"| {name} | {c} | {d.rps:,.0f} | {d.p50_ms:.2f} | {d.p99_ms:.2f} | {k.rps:,.0f} | "
                     f"{k.p50_ms:.2f} | {k.p99_ms:.2f} | {k.rps / d.rps if d.rps else 0:.2f} | "
                     f"{k.p50_ms - d.p50_ms:+.2f} | {k.gateway_cpu_us:,.0f} |")
    return "\n".join(lines)


def targets(rows: list[Row]) -> str:
    """The two targets, each with its measured value and OK / MISS."""
    cells = {(n, c): (d, k) for n, c, d, k in rows}
    parts = []
    if ("non-stream", 64) in cells:
        rps = cells[("non-stream", 64)][1].rps
        parts.append(f"non-stream c=64 through Kiln {rps:,.0f} rps (target ≥ {TARGET_RPS:,.0f}): "
                     f"{'OK' if rps >= TARGET_RPS else 'MISS'}")
    if ("non-stream", 1) in cells:
        d, k = cells[("non-stream", 1)]
        added = k.p50_ms - d.p50_ms
        parts.append(f"added p50 at c=1 {added:+.2f} ms (target ≤ {TARGET_ADDED_P50_MS:g} ms): "
                     f"{'OK' if added <= TARGET_ADDED_P50_MS else 'MISS'}")
    return "; ".join(parts) or "not measured (needs non-stream at c=1 and c=64)"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured cell (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before each cell (default 1)")
    p.add_argument("--quick", action="store_true", help="2 s cells, 1 s warm-up")
    p.add_argument("--concurrency", default="1,8,64", help="comma-separated connection counts (default 1,8,64)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(WORKLOADS))
    p.add_argument("--client", choices=("auto", "wrk", "aiohttp"), default="auto", help="load generator")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, config, database) and print it")
    a = p.parse_args()
    if a.quick:
        a.duration, a.warmup = 2.0, 1.0
    a.levels = [int(c) for c in a.concurrency.split(",")]
    a.workloads = [w for w in a.workloads.split(",") if w]
    if unknown := set(a.workloads) - set(WORKLOADS):
        p.error(f"unknown workload(s): {', '.join(sorted(unknown))}")
    return a


def main() -> int:
    a = parse_args()
    wrk = ensure_wrk() if a.client in ("auto", "wrk") else None
    if a.client == "wrk" and wrk is None:
        raise BenchError("wrk is not installed and could not be installed")
    gw_cpu, load_cpu, pin_note = cpus_for(a.no_pin)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind like Ctrl-C: every process is stopped
    load_before = os.getloadavg()[0]
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-"))  # logs, config, database
        if not a.keep:
            stack.callback(shutil.rmtree, tmp, True)  # runs last, after the processes are stopped
        sim_url, _ = start_sim(stack, tmp, load_cpu)
        gw_url, gw_proc = start_gateway(stack, tmp, sim_url, gw_cpu)
        org_id, key = create_tenant(gw_url)
        check_responses(gw_url, key)
        rows, sent, slack = measure(a, run_wrk if wrk else run_aiohttp, (sim_url, gw_url), key, load_cpu, gw_proc.pid)
        sent += len(WORKLOADS)  # check_responses' requests
        org_path, deadline = f"/orgs/{org_id}", time.monotonic() + 5  # cut-off requests are metered late
        while (events := admin(gw_url, "GET", org_path)["usage_events"]) < sent and time.monotonic() < deadline:
            time.sleep(0.2)
        rss = peak_rss_mb(gw_proc.pid)

    client = f"wrk ({wrk}), 1 thread" if wrk else "asyncio+aiohttp in-process (may itself be the bottleneck at high c)"
    ledger_ok = sent <= events <= sent + slack
    print(f"\n{fmt_table(rows)}\n")
    print(f"- load generator: {client}; {a.duration:g} s per cell after {a.warmup:g} s warm-up; "
          "simulator with zero delays; one gateway worker")
    print(f"- {pin_note}; 1-min load average before the run: {load_before:.2f} (other work skews the numbers)"
          + (f"\n- logs, config and database kept in {tmp}" if a.keep else ""))
    print(f"- gateway peak RSS (VmHWM): {rss:.1f} MiB")
    print(f"- usage ledger: {events:,} events for {sent:,} requests Kiln completed "
          f"(+ up to {slack:,} cut off at run ends): {'OK' if ledger_ok else 'MISMATCH'}")
    print("- targets: " + targets(rows))
    if not ledger_ok:
        raise BenchError(f"usage ledger has {events} events, expected {sent}..{sent + slack}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}\n(--keep keeps the simulator's and gateway's logs)", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted; all started processes stopped", file=sys.stderr)
        sys.exit(130)

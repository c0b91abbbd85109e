"""The load generator: wrk (one thread, c keep-alive connections, bench/post.lua), or an
in-process asyncio+aiohttp client when wrk is missing (it may itself be the bottleneck at high c).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from servers import BenchError, pinned

WRK_SCRIPT = Path(__file__).with_name("post.lua")


@dataclass
class Result:
    requests: int  # completed requests
    seconds: float
    errors: int  # non-2xx responses + socket errors + timeouts
    p50_ms: float
    p99_ms: float
    cpu_us: float = 0.0  # the server's CPU time (user + system) per completed request
    # Kiln's cells with --repeat > 1: its rps and its CPU per request over the bare proxy's in the
    # run just before it, one pair per round (measure.table)
    paired_rps: list[float] = field(default_factory=list)
    paired_cpu: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@dataclass
class Load:
    """What to send: a base URL, one or more (path, body) requests taken in turn, and headers."""

    url: str
    requests: list[tuple[str, bytes]]
    headers: dict[str, str] = field(default_factory=dict)


def ensure_wrk() -> str | None:
    """Path of wrk, installing it with apt-get if possible; None when unavailable."""
    if shutil.which("wrk") is None and shutil.which("apt-get") and os.geteuid() == 0:
        print("wrk not found; trying `apt-get install -y wrk` ...", flush=True)
        subprocess.run(["apt-get", "install", "-y", "wrk"], capture_output=True, check=False)
    return shutil.which("wrk")


def run_wrk(load: Load, conc: int, seconds: float, cpu: int | None, timeout_s: float = 30) -> Result:
    """wrk, one thread, `conc` connections, for `seconds` (rounded to whole seconds, at least 1)."""
    with tempfile.TemporaryDirectory(prefix="kiln-bench-wrk-") as tmp:
        lines = []
        for i, (path, body) in enumerate(load.requests):
            file = Path(tmp) / f"body{i}.json"
            file.write_bytes(body)
            lines.append(f"{path}\t{file}")
        listing = Path(tmp) / "requests.tsv"
        listing.write_text("\n".join(lines) + "\n")
        env = {**os.environ, "BENCH_REQUESTS": str(listing),
               "BENCH_HEADERS": "\n".join(f"{k}: {v}" for k, v in load.headers.items())}
        cmd = ["wrk", "-t1", f"-c{conc}", f"-d{max(1, round(seconds))}s", "--timeout", f"{timeout_s:g}s",
               "-s", str(WRK_SCRIPT), load.url]
        out = subprocess.run(pinned(cmd, cpu), capture_output=True, text=True, check=False, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise BenchError(f"wrk failed ({out.returncode}): {out.stdout}{out.stderr}")
    n, usec, status, *sock, p50, p99 = (int(x) for x in line.split()[1:])
    return Result(n, usec / 1e6, status + sum(sock), p50 / 1000, p99 / 1000)


def run_aiohttp(load: Load, conc: int, seconds: float, cpu: int | None, timeout_s: float = 30) -> Result:
    """The fallback client, run in this process (pinned to `cpu` for the run)."""
    before = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        return asyncio.run(_aiohttp_load(load, conc, seconds, timeout_s))
    finally:
        os.sched_setaffinity(0, before)


async def _aiohttp_load(load: Load, conc: int, seconds: float, timeout_s: float) -> Result:
    import aiohttp

    headers = {"Content-Type": "application/json", **load.headers}
    latencies: list[float] = []
    errors = 0
    turn = 0
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()
        end = start + seconds

        async def worker() -> None:
            nonlocal errors, turn
            while (t0 := time.perf_counter()) < end:
                path, body = load.requests[turn % len(load.requests)]
                turn += 1
                try:
                    async with session.post(load.url + path, data=body, headers=headers) as resp:
                        await resp.read()
                        errors += resp.status >= 400
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(conc)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return Result(len(latencies), elapsed, errors, percentile_ms(latencies, 0.50), percentile_ms(latencies, 0.99))


def percentile_ms(ordered: list[float], q: float) -> float:
    """The q-quantile (0..1) of sorted latencies in seconds, in ms."""
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1000 if ordered else 0.0

"""Kiln scale-out benchmark: what shared admission costs, and what a second worker brings.

Four gateways in turn, each in front of the same simulator (zero delays), with
the same load (wrk, or the aiohttp fallback, from bench/run.py):

    memory      1 worker, in-process admission, SQLite          (the embedded default)
    memory+pg   1 worker, in-process admission, PostgreSQL       (what the database alone costs)
    redis+pg    1 worker, RedisAdmission, PostgreSQL             (target: >= 85% of `memory` rps)
    redis+pg x2 2 workers, RedisAdmission, PostgreSQL            (target: >= 1.6x `redis+pg` rps)

Redis is a private redis-server on a free port; PostgreSQL is the one at
$KILN_BENCH_PG (default postgresql://postgres@127.0.0.1:5432/test), in a schema
of its own, dropped afterwards. Pinning as in bench/run.py: gateway workers on
the first CPU (two workers: on both), simulator, Redis and load generator on
the second. Prints one markdown table.

    .venv/bin/python bench/scaleout.py [--duration 5] [--quick] [--concurrency 1,64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402  (bench/run.py: its processes, clients and checks)

SETUPS = ("memory", "memory+pg", "redis+pg", "redis+pg x2")
TARGET_REDIS_SHARE = 0.85
TARGET_SCALING = 1.6


def start_redis(stack: ExitStack, tmp: Path, cpu: int | None) -> str:
    port = run.free_port()
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    log = tmp / "redis.log"
    proc = run.spawn(stack, run.pinned([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                        "--appendonly", "no"], cpu), log)
    run.wait_until(lambda: "Ready to accept" in log.read_text(errors="replace"), proc, log, "redis-server")
    return f"redis://127.0.0.1:{port}/0"


def start_gateway(stack: ExitStack, tmp: Path, name: str, sim_url: str, env: dict[str, str], workers: int,
                  cpus: str | None) -> tuple[str, subprocess.Popen[bytes]]:
    """`kiln serve` as bench/run.py writes it, with this setup's environment and worker count."""
    config = tmp / f"{name}.toml"
    config.write_text(f"""
[limits]
rpm = 100000000
concurrency = 100000

[[models]]
id = "{run.MODEL}"
context_window = 32768
max_output_tokens = 8192
prices = {{ input = "0.10", output = "0.30" }}
[[models.backends]]
url = "{sim_url}/v1"
""")
    port, log = run.free_port(), tmp / f"{name}.log"
    cmd = [run.PY, "-m", "kiln", "serve", "--config", str(config), "--port", str(port),
           "--data-dir", str(tmp / name), "--workers", str(workers)]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    proc = run.spawn(stack, cmd, log, env={**os.environ, "KILN_ADMIN_KEY": run.ADMIN_KEY, **env})
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return run.http("GET", url + "/health")[0] == 200
        except OSError:
            return False

    run.wait_until(healthy, proc, log, f"kiln serve ({name})")
    if workers > 1:
        time.sleep(2)  # the other workers finish their start-up too
    return url, proc


def gateway_pids(proc: subprocess.Popen[bytes] | None) -> list[int]:
    """The gateway and its workers (the children of a --workers parent)."""
    if proc is None:
        return []
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == proc.pid:
                children.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return [proc.pid, *children]


def measure(load: Any, url: str, key: str, body: dict[str, Any], conc: int, a: argparse.Namespace,
            cpu: int | None, proc: subprocess.Popen[bytes] | None = None) -> run.Result:
    if a.warmup > 0:
        load(url, body, key, conc, a.warmup, cpu)
    pids = gateway_pids(proc)
    before = sum(run.cpu_seconds(pid) for pid in pids)
    res = load(url, body, key, conc, a.duration, cpu)
    res.gateway_cpu_us = (sum(run.cpu_seconds(pid) for pid in pids) - before) * 1e6 / max(res.requests, 1)
    if res.errors:
        raise run.BenchError(f"{url} c={conc}: {res.errors} failed requests")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="2 s cells")
    p.add_argument("--concurrency", default="1,64")
    p.add_argument("--workload", default="non-stream", choices=sorted(run.WORKLOADS))
    p.add_argument("--no-pin", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.duration = 2.0
    levels = [int(c) for c in a.concurrency.split(",")]
    wrk = run.ensure_wrk()
    load = run.run_wrk if wrk else run.run_aiohttp
    gw_cpu, load_cpu, pin_note = run.cpus_for(a.no_pin)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    pg = os.environ.get("KILN_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
    schema = f"kiln_bench_{secrets.token_hex(4)}"
    body = run.WORKLOADS[a.workload]
    load_before = os.getloadavg()[0]
    rows: dict[tuple[str, int], run.Result] = {}
    direct: dict[int, run.Result] = {}
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-scale-"))
        stack.callback(shutil.rmtree, tmp, True)
        for n in range(len(SETUPS)):
            stack.callback(drop_schema, pg, f"{schema}_{n}")
        sim_url, _ = run.start_sim(stack, tmp, load_cpu)
        redis_url = start_redis(stack, tmp, load_cpu)
        for c in levels:
            direct[c] = measure(load, sim_url + "/v1/chat/completions", "", body, c, a, load_cpu)
        for n, name in enumerate(SETUPS):
            env: dict[str, str] = {}
            if "pg" in name:
                env["KILN_DATABASE"] = f"{pg}?schema={schema}_{n}"
            if "redis" in name:
                env.update(KILN_REDIS_URL=redis_url, KILN_REDIS_PREFIX=f"bench-{schema}")
            workers = 2 if name.endswith("x2") else 1
            cpus = None if gw_cpu is None else (f"{gw_cpu},{load_cpu}" if workers > 1 else str(gw_cpu))
            with ExitStack() as gateway:
                url, proc = start_gateway(gateway, tmp, name.replace(" ", "").replace("+", "-"), sim_url, env,
                                          workers, cpus)
                _, key = run.create_tenant(url)
                deadline = time.monotonic() + 10  # every worker knows the new key (a notice, within a second)
                while any(run.http("GET", url + "/v1/key", token=key)[0] != 200 for _ in range(4 * workers)):
                    if time.monotonic() > deadline:
                        raise run.BenchError("the new key did not reach every worker")
                    time.sleep(0.1)
                run.check_responses(url, key)
                for c in levels:
                    rows[(name, c)] = res = measure(load, url + "/v1/chat/completions", key, body, c, a, load_cpu,
                                                    proc)
                    print(f"  {name:12} c={c:<3} {res.rps:7,.0f} rps  p50 {res.p50_ms:6.2f} ms  "
                          f"p99 {res.p99_ms:6.2f} ms  {res.gateway_cpu_us:5.0f} µs CPU/req", flush=True)
    print("\n| setup | c | rps | p50 ms | p99 ms | added p50 ms | added p99 ms | rps vs memory | gateway CPU µs/req |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for (name, c), r in rows.items():
        d, base = direct[c], rows[("memory", c)]
        print(f"| {name} | {c} | {r.rps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.p50_ms - d.p50_ms:+.2f} | "
              f"{r.p99_ms - d.p99_ms:+.2f} | {r.rps / base.rps:.2f} | {r.gateway_cpu_us:,.0f} |")
    top = max(levels)
    share = rows[("redis+pg", top)].rps / rows[("memory", top)].rps
    scaling = rows[("redis+pg x2", top)].rps / rows[("redis+pg", top)].rps
    print(f"\n- workload {a.workload}; direct to the simulator: "
          + ", ".join(f"c={c} {d.rps:,.0f} rps p50 {d.p50_ms:.2f} ms" for c, d in direct.items()))
    print(f"- load generator: {'wrk' if wrk else 'aiohttp'}; {a.duration:g} s per cell after {a.warmup:g} s warm-up")
    print(f"- {pin_note}; two workers: taskset on both CPUs; 1-min load average before: {load_before:.2f}")
    cpu_share = rows[("memory", top)].gateway_cpu_us / rows[("redis+pg", top)].gateway_cpu_us
    print(f"- CPU per request, c={top}: in-process admission / RedisAdmission + PostgreSQL = {cpu_share:.2f}"
          " (the rps share a CPU-bound worker would reach; less sensitive to a loaded machine)")
    print(f"- RedisAdmission + PostgreSQL, 1 worker, c={top}: {share:.2f} of in-process admission's rps "
          f"(target >= {TARGET_REDIS_SHARE:.2f}): {'OK' if share >= TARGET_REDIS_SHARE else 'MISS'}")
    print(f"- 2 workers over 1 (Redis + PostgreSQL), c={top}: {scaling:.2f}x (target >= {TARGET_SCALING:.1f}x): "
          f"{'OK' if scaling >= TARGET_SCALING else 'MISS'}")
    return 0


def drop_schema(dsn: str, schema: str) -> None:
    import asyncpg

    async def drop() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await conn.close()

    asyncio.run(drop())


if __name__ == "__main__":
    try:
        sys.exit(main())
    except run.BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)

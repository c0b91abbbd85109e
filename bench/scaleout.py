"""Kiln scale-out benchmark: what shared admission costs, and what a second worker brings.

Each setup is a fresh gateway in front of the same simulator (zero delays), driven by the same
load generator as bench/run.py (bench/load.py: wrk, or the aiohttp fallback):

    memory       1 worker, in-process admission, SQLite        (the embedded default)
    memory x2    2 workers, in-process admission, SQLite       (Kiln refuses it: n/a with its reason)
    memory+pg    1 worker, in-process admission, PostgreSQL    (what the database alone costs)
    redis        1 worker, Redis admission, SQLite             (what shared admission alone costs)
    redis+pg     1 worker, Redis admission, PostgreSQL         (target: >= 85% of `memory` rps)
    redis+pg x2  2 workers, Redis admission, PostgreSQL        (target: >= 1.7x `redis+pg` rps)

PostgreSQL is the one at $KILN_BENCH_PG (default postgresql://postgres@127.0.0.1:5432/test), a
schema of its own per setup (random suffix), dropped afterwards; Redis the one at $KILN_BENCH_REDIS
(default redis://127.0.0.1:6379/0), a key prefix of its own per setup, whose keys are deleted
afterwards (never FLUSHALL). Pinning as in bench/run.py: one worker on the gateway CPU, two workers
on both CPUs (the second then shares its CPU with the simulator and the load generator).
bench/run.py's `workers` and `redis` sections are made of these setups.

    .venv/bin/python bench/scaleout.py [--duration 5] [--quick] [--concurrency 1,64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from load import Load, Result, ensure_wrk, run_aiohttp, run_wrk
from measure import Bench, ledger_line, measure, prepare
from servers import BenchError, Server, cpus_for, create_tenant, http, start_kiln, start_sim
from workloads import Workload, make

PG = os.environ.get("KILN_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("KILN_BENCH_REDIS", "redis://127.0.0.1:6379/0")
TARGET_REDIS_SHARE = 0.85  # Redis admission's rps / in-process admission's, one worker
TARGET_SCALING = 1.7  # two workers' rps / one worker's (issue: scale-out)
CONCURRENCY = 64  # the sections' connection count


@dataclass(frozen=True)
class Setup:
    database: str  # "SQLite" or "PostgreSQL"
    admission: str  # "in-process" or "Redis"
    workers: int

    @property
    def label(self) -> str:
        return f"{self.database}, {self.admission} admission"


SETUPS = {
    "memory": Setup("SQLite", "in-process", 1),
    "memory x2": Setup("SQLite", "in-process", 2),
    "memory+pg": Setup("PostgreSQL", "in-process", 1),
    "redis": Setup("SQLite", "Redis", 1),
    "redis+pg": Setup("PostgreSQL", "Redis", 1),
    "redis+pg x2": Setup("PostgreSQL", "Redis", 2),
}
CLI_SETUPS = ("memory", "memory+pg", "redis+pg", "redis+pg x2")
ONE_WORKER = tuple(name for name, setup in SETUPS.items() if setup.workers == 1)  # instructions.py, profile.py
WORKLOADS = {"non-stream": ("json", False), "stream": ("stream", True)}  # CLI name -> chat workload


def pg_problem(dsn: str = PG) -> str | None:
    """Why PostgreSQL cannot be used (None: it answers)."""
    try:
        import asyncpg
    except ImportError:
        return "asyncpg is not installed (pip install -e '.[postgres]')"

    async def ping() -> None:
        conn = await asyncpg.connect(dsn, timeout=5)
        await conn.close()

    try:
        asyncio.run(ping())
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError) as exc:
        return f"PostgreSQL at {dsn} unreachable ({type(exc).__name__}: {exc})"
    return None


def redis_problem(url: str = REDIS) -> str | None:
    """Why Redis cannot be used (None: it answers PING)."""
    try:
        from kiln.core.resp import Resp
    except ImportError:  # hiredis, Kiln's optional dependency for Redis
        return "hiredis is not installed (pip install -e '.[redis]')"

    async def ping() -> object:
        redis = Resp(url, timeout_s=5)
        try:
            return await redis.call("PING")
        finally:
            await redis.close()

    try:
        asyncio.run(ping())
    except (OSError, ConnectionError, asyncio.TimeoutError) as exc:
        return f"Redis at {url} unreachable ({type(exc).__name__}: {exc})"
    return None


def drop_schema(dsn: str, schema: str) -> None:
    import asyncpg

    async def drop() -> None:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await conn.close()

    asyncio.run(drop())


def drop_keys(url: str, prefix: str) -> None:
    """Delete one setup's keys from the shared Redis (Kiln's are PREFIX:...; SCAN, never FLUSHALL)."""
    from kiln.core.resp import Resp

    async def drop() -> None:
        redis, cursor = Resp(url, timeout_s=10), "0"
        try:
            while True:
                cursor, keys = await redis.call("SCAN", cursor, "MATCH", f"{prefix}:*", "COUNT", 1000)
                if keys:
                    await redis.call("DEL", *keys)
                if cursor in ("0", b"0"):
                    break
        finally:
            await redis.close()

    asyncio.run(drop())


@dataclass
class Scale:
    """What every setup shares: the simulator, the load generator and its CPU, the pinning, the cells."""

    sim: Server
    run: Callable[..., Result]
    pins: tuple[int | None, int | None]  # (gateway CPU, simulator + load CPU)
    duration: float
    warmup: float
    tmp: Path
    repeat: int = 1  # runs per cell, the best kept
    tag: str = field(default_factory=lambda: secrets.token_hex(4))  # schema and key-prefix suffix
    cells: dict[tuple[str, str, int], Result] = field(default_factory=dict)  # (setup, workload, c)
    direct: dict[tuple[str, int], Result] = field(default_factory=dict)  # (workload, c): the simulator
    refused: dict[str, str] = field(default_factory=dict)  # setup -> why it has no figures
    ledger: list[str] = field(default_factory=list)
    problems: dict[str, str | None] = field(default_factory=dict)  # service -> why unreachable

    def cpus(self, workers: int) -> str | None:
        gw, load = self.pins
        if gw is None or load is None:
            return None
        return f"{gw},{load}" if workers > 1 else str(gw)

    def unreachable(self, setup: Setup) -> str | None:
        """Why a service the setup needs cannot be used (checked once per run)."""
        needs = [("PostgreSQL", pg_problem)] if setup.database == "PostgreSQL" else []
        needs += [("Redis", redis_problem)] if setup.admission == "Redis" else []
        for service, probe in needs:
            if service not in self.problems:
                self.problems[service] = probe()
            if self.problems[service]:
                return self.problems[service]
        return None


def setup_services(stack: ExitStack, name: str, suffix: str) -> dict[str, str]:
    """The environment of setup `name`'s gateway: its own PostgreSQL schema and/or Redis key prefix."""
    setup = SETUPS[name]
    return own_services(stack, suffix, setup.database == "PostgreSQL", setup.admission == "Redis")


def own_services(stack: ExitStack, suffix: str, pg: bool, redis: bool) -> dict[str, str]:
    """The environment of a gateway with a PostgreSQL schema and/or a Redis key prefix of its own,
    both removed when `stack` closes (after the gateway stopped: callbacks run last in, first out)."""
    env: dict[str, str] = {}
    if pg:
        stack.callback(drop_schema, PG, f"kiln_bench_{suffix}")
        env["KILN_DATABASE"] = f"{PG}?schema=kiln_bench_{suffix}"
    if redis:
        stack.callback(drop_keys, REDIS, f"kiln-bench-{suffix}")
        env.update(KILN_REDIS_URL=REDIS, KILN_REDIS_PREFIX=f"kiln-bench-{suffix}")
    return env


def start_setup(s: Scale, stack: ExitStack, name: str) -> Server | None:
    """The setup's gateway, with its own schema and key prefix (cleaned up when `stack` closes);
    None when it cannot run (s.refused says why)."""
    setup = SETUPS[name]
    if problem := s.unreachable(setup):
        s.refused[name] = problem
        return None
    slug = name.replace(" ", "-").replace("+", "-")
    suffix = f"{s.tag}_{slug.replace('-', '_')}"
    env = setup_services(stack, name, suffix)
    try:
        return start_kiln(stack, s.tmp, s.sim.url, s.cpus(setup.workers), name=slug, workers=setup.workers,
                          env=env)
    except BenchError:
        log = (s.tmp / f"{slug}.log").read_text(errors="replace")
        refusal = [ln.removeprefix("kiln: ") for ln in log.splitlines() if "needs" in ln]
        if not refusal:
            raise
        s.refused[name] = "Kiln refuses to start: " + "; ".join(refusal)
        return None


def known_everywhere(kiln: Server, key: str, workers: int) -> None:
    """Wait until every worker knows the new key (a change notice, within a second): new
    connections land on any worker, so many requests in a row must all pass."""
    deadline = time.monotonic() + 15
    headers = {"Authorization": f"Bearer {key}"}
    while any(http("GET", kiln.url + "/v1/key", headers=headers)[0] != 200 for _ in range(8 * workers)):
        if time.monotonic() > deadline:
            raise BenchError("the new key did not reach every worker within 15 s")
        time.sleep(0.1)


def run_setup(s: Scale, name: str, workloads: list[Workload], levels: list[int], direct: bool = False) -> None:
    """Start the setup's gateway, check each workload through it, measure it at every level,
    check its ledger, stop it. `direct`: also the simulator alone, once per workload and level."""
    print(f"  {name}: {SETUPS[name].label}, {SETUPS[name].workers} worker(s)", flush=True)
    with ExitStack() as stack:
        kiln = start_setup(s, stack, name)
        if kiln is None:
            print(f"    n/a: {s.refused[name]}", flush=True)
            return
        org_id, key = create_tenant(kiln)
        known_everywhere(kiln, key, SETUPS[name].workers)
        b = Bench({"direct": s.sim, "kiln": kiln}, key, s.run, s.pins[1], s.duration, s.warmup)
        for w in workloads:
            wanted = ["kiln", "direct"] if direct and not any(k[0] == w.name for k in s.direct) else ["kiln"]
            loads = prepare(b, w, wanted)
            for c in levels:
                for target in wanted:
                    load = loads[target]
                    assert isinstance(load, Load)
                    runs = [measure(b, target, load, c, f"{name} {w.key} c={c}") for _ in range(s.repeat)]
                    res = max(runs, key=lambda r: r.rps)  # the run least disturbed by other work
                    if target == "direct":
                        s.direct[(w.name, c)] = res
                        continue
                    s.cells[(name, w.name, c)] = res
                    print(f"    {w.key:12} c={c:<3} {res.rps:7,.0f} rps  p50 {res.p50_ms:6.2f} ms  "
                          f"p99 {res.p99_ms:6.2f} ms  {res.cpu_us:6,.0f} µs CPU/req", flush=True)
        s.ledger.append(ledger_line(b, org_id, f" ({name})"))


def cells_table(s: Scale, names: list[str]) -> list[str]:
    """One row per setup, workload and level; with the simulator's figures, the latency Kiln adds."""
    added = bool(s.direct)
    head = "| setup | database | admission | workers | CPUs | workload | c | rps | p50 ms | p99 ms |"
    head += " added p50 ms | added p99 ms |" if added else ""
    lines = [head + " CPU µs/req | gateway CPU % |",
             "|---|---|---|--:|---|---|--:|--:|--:|--:|" + "--:|" * (4 if added else 2)]
    for (name, workload, c), r in s.cells.items():
        if name not in names:
            continue
        setup, cpus = SETUPS[name], s.cpus(SETUPS[name].workers) or "any"
        row = (f"| {name} | {setup.database} | {setup.admission} | {setup.workers} | {cpus} | chat {workload} | {c} "
               f"| {r.rps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} |")
        if added:
            d = s.direct[(workload, c)]
            row += f" {r.p50_ms - d.p50_ms:+.2f} | {r.p99_ms - d.p99_ms:+.2f} |"
        lines.append(row + f" {r.cpu_us:,.0f} | {r.rps * r.cpu_us / 1e4:.0f} |")  # 100: one core busy
    lines += [f"- {name}: n/a: {why}" for name, why in s.refused.items() if name in names]
    return lines


def compare(s: Scale, over: str, base: str, target: float, what: str) -> list[str]:
    """`over`'s rps ÷ `base`'s per workload and level, judged against `target`; beside it the same
    judged by CPU per request (workers × CPU µs/req ratio: what CPU-bound gateways would reach,
    which moves less than rps on a busy machine)."""
    out = []
    for (name, workload, c), b in s.cells.items():
        o = s.cells.get((over, workload, c))
        if name != base or o is None:
            continue
        ratio = o.rps / b.rps if b.rps else 0.0
        by_cpu = SETUPS[over].workers / SETUPS[base].workers * b.cpu_us / o.cpu_us if o.cpu_us else 0.0
        line = (f"- {what}, chat {workload} c={c}: {ratio:.2f}× rps (target ≥ {target:g}×: "
                f"{'OK' if ratio >= target else 'MISS'}); CPU µs/req {o.cpu_us:,.0f} vs {b.cpu_us:,.0f}")
        out.append(line + (f", by CPU per request {by_cpu:.2f}×" if c > 1 else ""))  # c=1 saturates nothing
    out += [f"- {what}: n/a ({name} did not run, see above)" for name in (over, base) if name in s.refused]
    return out


def pin_note(s: Scale) -> str:
    gw, load = s.pins
    if gw is None:
        return "- no CPU pinning: every worker, the simulator and the load generator share all CPUs"
    return (f"- 1 worker: Kiln alone on CPU {gw}; 2 workers: Kiln on CPUs {gw} and {load}, so the second worker "
            f"**shares CPU {load} with the simulator and the load generator** ({len(os.sched_getaffinity(0))} CPUs "
            "here): the 2-worker rps is what the gateway gets beside them, not a second core of its own")


def chat_workloads(modes: list[str]) -> list[Workload]:
    return [make("chat", mode, mode == "stream") for mode in modes]


def workers_section(s: Scale, modes: list[str]) -> list[str]:
    """bench/run.py `workers`: 1 worker pinned to one core vs 2 workers on two, on SQLite and
    PostgreSQL, chat `modes` (json, stream) at c=64."""
    names = ["memory", "memory x2", "redis+pg", "redis+pg x2"]
    for name in names:
        run_setup(s, name, chat_workloads(modes), [CONCURRENCY])
    return ["", "Workers (chat, c=64; 2 workers need PostgreSQL and Redis admission):", "", *cells_table(s, names),
            *compare(s, "memory x2", "memory", TARGET_SCALING, "SQLite, 2 workers / 1 worker"),
            *compare(s, "redis+pg x2", "redis+pg", TARGET_SCALING, "PostgreSQL + Redis, 2 workers / 1 worker"),
            pin_note(s)]


def redis_section(s: Scale, modes: list[str]) -> list[str]:
    """bench/run.py `redis`: one worker on PostgreSQL, in-process admission vs Redis admission,
    chat `modes` at c=64. The same database for both: on SQLite only in-process admission gets
    the ledger's journal (kiln.wiring), which would count as Redis's cost."""
    names = ["memory+pg", "redis+pg"]
    for name in names:
        if not any(k[0] == name for k in s.cells):  # the workers section may have measured it
            run_setup(s, name, chat_workloads(modes), [CONCURRENCY])
    return ["", "Admission (one worker on PostgreSQL, chat, c=64):", "", *cells_table(s, names),
            *compare(s, "redis+pg", "memory+pg", TARGET_REDIS_SHARE,
                     "Redis / in-process admission (PostgreSQL both)"),
            f"- Redis: {REDIS} (shared with other work on this machine, not pinned), a key prefix of its own"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured cell (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before each cell (default 1)")
    p.add_argument("--quick", action="store_true", help="2 s cells")
    p.add_argument("--concurrency", default="1,64", help="connection counts (default 1,64)")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell, the best kept (default 1)")
    p.add_argument("--workload", default="non-stream", choices=sorted(WORKLOADS), help="chat, 20 tokens")
    p.add_argument("--setups", default=",".join(CLI_SETUPS), help="subset of " + ",".join(SETUPS))
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    a = p.parse_args()
    if a.quick:
        a.duration = 2.0
    a.levels = [int(c) for c in a.concurrency.split(",") if c]
    a.setups = [x for x in a.setups.split(",") if x]
    if unknown := set(a.setups) - set(SETUPS):
        p.error(f"--setups: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SETUPS)})")
    return a


def main() -> int:
    a = parse_args()
    wrk = ensure_wrk()
    gw_cpu, load_cpu, pins = cpus_for(a.no_pin)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind like Ctrl-C: every process is stopped
    load_before = os.getloadavg()[0]
    mode, stream = WORKLOADS[a.workload]
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-scale-"))
        stack.callback(shutil.rmtree, tmp, True)
        sim = start_sim(stack, tmp, load_cpu)
        s = Scale(sim, run_wrk if wrk else run_aiohttp, (gw_cpu, load_cpu), a.duration, a.warmup, tmp, a.repeat)
        for name in a.setups:
            run_setup(s, name, [make("chat", mode, stream)], a.levels, direct=True)
    print("\n" + "\n".join(cells_table(s, a.setups)))
    for line in [*compare(s, "redis+pg", "memory", TARGET_REDIS_SHARE,
                          "Redis admission + PostgreSQL / in-process admission on SQLite, 1 worker"),
                 *compare(s, "redis+pg x2", "redis+pg", TARGET_SCALING, "2 workers / 1 worker (Redis + PostgreSQL)"),
                 *s.ledger]:
        print(line)
    print(f"- workload chat {a.workload} (20 tokens); direct to the simulator: " + ", ".join(
        f"c={c} {d.rps:,.0f} rps p50 {d.p50_ms:.2f} ms" for (_, c), d in s.direct.items()))
    print(f"- load generator: {f'wrk ({wrk}), 1 thread' if wrk else 'asyncio+aiohttp in-process'}; "
          f"{a.duration:g} s per cell after {a.warmup:g} s warm-up")
    print(f"{pin_note(s)}\n- {pins}; 1-min load average before: {load_before:.2f} (other work skews the numbers)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted; all started processes stopped", file=sys.stderr)
        sys.exit(130)

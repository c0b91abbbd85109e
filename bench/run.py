"""Kiln load benchmark: every protocol through Kiln, beside the model server called directly,
a bare pass-through proxy and LiteLLM, in one run with one load generator.

One run starts `kiln sim` (zero delays), Kiln, the bare proxy and LiteLLM (each pinned to the
gateway CPU), creates an org/project/key, checks every workload through every target, drives
load with wrk (or an asyncio+aiohttp fallback), checks the usage ledger, and prints the tables.

    .venv/bin/python bench/run.py [--quick] [--sections table,long,slow,rss] (see bench/README.md)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import litellm_env
import report
from load import Result, ensure_wrk, run_aiohttp, run_wrk
from measure import PACE, TARGETS, Bench, first_token, ledger_line, long_streams, paced_streams, table
from servers import (START_NOFILE, BenchError, Server, cpus_for, create_tenant, raise_nofile, start_bare,
                     start_kiln, start_litellm, start_sim)
from scaleout import Scale, redis_section, workers_section
from soak import rss_over_time, slow_streams
from workloads import PROTOCOLS, table_workloads

SECTIONS = ("table", "long", "slow", "rss", "workers", "redis")
SCALE_SECTIONS = ("workers", "redis")  # gateways of their own (bench/scaleout.py), PostgreSQL and Redis
MODES = ("json", "stream", "agent")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measured cell (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before each cell (default 1)")
    p.add_argument("--quick", action="store_true", help="2 s cells, 1 s warm-up, a 20,000-request RSS run")
    p.add_argument("--repeat", type=int, default=1, help="table, workers, redis: runs per cell, the best kept "
                   "(default 1; 3 on a busy machine); table: from 3, Kiln/bare targets are judged on the "
                   "median of each round's pair")
    p.add_argument("--concurrency", default="1,64", help="table: connection counts (default 1,64; add 8 if wanted)")
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help="subset of " + ",".join(PROTOCOLS))
    p.add_argument("--modes", default=",".join(MODES), help="table rows: subset of " + ",".join(MODES))
    p.add_argument("--targets", default=",".join(TARGETS), help="table: subset of " + ",".join(TARGETS)
                   + " (kiln always runs)")
    p.add_argument("--long-targets", default="kiln,bare", help="long streams: kiln and/or bare (default both)")
    p.add_argument("--slow-streams", type=int, default=2000, help="slow: concurrent streams (default 2,000)")
    p.add_argument("--slow-protocol", default="chat", choices=PROTOCOLS, help="slow: protocol (default chat)")
    p.add_argument("--slow-body", default="small", choices=("small", "agent"),
                   help="slow: small requests, or the 60 KB agent bodies (messages, responses)")
    p.add_argument("--slow-rate", type=float, default=250.0, help="slow: streams opened per second, at most "
                   "(default 250)")
    p.add_argument("--slow-tokens", type=int, default=0, help="slow: tokens (= seconds) per stream "
                   "(default N / 100 + 15)")
    p.add_argument("--slow-workers", type=int, default=1,
                   help="slow: Kiln workers (default 1; more run on PostgreSQL and Redis, $KILN_BENCH_PG and "
                        "$KILN_BENCH_REDIS, each with its own open-file limit)")
    p.add_argument("--rss-requests", type=int, default=100_000, help="rss: requests in all (default 100,000)")
    p.add_argument("--rss-concurrency", type=int, default=64, help="rss: connections (default 64)")
    p.add_argument("--full", action="store_true", help="the targets' sizes: 10,000 slow streams, 1,000,000 RSS requests")
    p.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn",
                   help="serve Kiln and the bare proxy with uvicorn (Kiln's default) or Granian")
    p.add_argument("--gateway-nofile", type=int, default=0,
                   help="open-file limit for the gateways (default: the limit this run was started with)")
    p.add_argument("--client", choices=("auto", "wrk", "aiohttp"), default="auto", help="load generator")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to CPUs")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, configs, database) and print it")
    a = p.parse_args()
    if a.quick:
        a.duration, a.warmup = 2.0, 1.0
        a.rss_requests = min(a.rss_requests, 20_000)
    if a.full:
        a.slow_streams, a.rss_requests = 10_000, 1_000_000
    a.sections = _subset(p, "sections", a.sections, SECTIONS)
    a.protocols = _subset(p, "protocols", a.protocols, PROTOCOLS)
    a.modes = _subset(p, "modes", a.modes, MODES)
    a.targets = _subset(p, "targets", a.targets, TARGETS)
    a.long_targets = _subset(p, "long-targets", a.long_targets, ("kiln", "bare"))
    a.levels = [int(c) for c in a.concurrency.split(",") if c]
    return a


def _subset(p: argparse.ArgumentParser, flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [x for x in value.split(",") if x]
    if unknown := set(items) - set(allowed):
        p.error(f"--{flag}: unknown {', '.join(sorted(unknown))} (choose from {', '.join(allowed)})")
    return [x for x in allowed if x in items]  # canonical order


def start_targets(a: argparse.Namespace, stack: ExitStack, tmp: Path, sim: Server, gw_cpu: int | None,
                  nofile: tuple[int, int]) -> tuple[dict[str, Server], dict[str, str]]:
    """Kiln always; the bare proxy and LiteLLM when asked for (LiteLLM: n/a with the reason if it fails)."""
    wanted = (set(a.targets) if "table" in a.sections else set()) | (set(a.long_targets) if "long" in a.sections else set())
    servers = {"direct": sim, "kiln": start_kiln(stack, tmp, sim.url, gw_cpu, a.server, nofile)}
    unavailable: dict[str, str] = {}
    if "bare" in wanted:
        servers["bare"] = start_bare(stack, tmp, sim.url, gw_cpu, a.server, nofile)
    if "litellm" in wanted:
        try:
            servers["litellm"] = start_litellm(stack, tmp, sim.url, gw_cpu, nofile)
        except (BenchError, RuntimeError, OSError) as exc:
            unavailable["litellm"] = f"LiteLLM did not start: {str(exc).splitlines()[0][:200]}"
            print(f"  {unavailable['litellm']}", flush=True)
    return servers, unavailable


def idle_cpu(servers: dict[str, Server], seconds: float = 2.0) -> str:
    """Each gateway's CPU use while idle (background tasks also take the gateway core)."""
    gateways = {n: s for n, s in servers.items() if n != "direct"}
    before = {n: s.cpu_seconds() for n, s in gateways.items()}
    time.sleep(seconds)
    return ", ".join(f"{report.NAMES[n]} {(s.cpu_seconds() - before[n]) * 100 / seconds:.1f}%"
                     for n, s in gateways.items())


def run(a: argparse.Namespace, stack: ExitStack, tmp: Path, load_fn: Callable[..., Result],
        pins: tuple[int | None, int | None]) -> list[str]:
    """Start the simulator, run the sections, return the report lines."""
    sim = start_sim(stack, tmp, pins[1])
    out: list[str] = []
    if set(a.sections) - set(SCALE_SECTIONS):
        with ExitStack() as gateways:  # stopped before the scale-out sections start their own
            out += main_sections(a, gateways, tmp, sim, load_fn, pins)
    if set(a.sections) & set(SCALE_SECTIONS):
        s = Scale(sim, load_fn, pins, a.duration, a.warmup, tmp, a.repeat)
        modes = [m for m in a.modes if m in ("json", "stream")] or ["json", "stream"]
        if "workers" in a.sections:
            print("workers (1 vs 2):", flush=True)
            out += workers_section(s, modes)
        if "redis" in a.sections:
            print("admission (in-process vs Redis, on PostgreSQL):", flush=True)
            out += redis_section(s, modes)
        out += s.ledger
    return out


def main_sections(a: argparse.Namespace, stack: ExitStack, tmp: Path, sim: Server, load_fn: Callable[..., Result],
                  pins: tuple[int | None, int | None]) -> list[str]:
    """table, long, rss, slow: Kiln beside its peers, one worker each."""
    gw_cpu, load_cpu = pins
    nofile = (a.gateway_nofile, max(a.gateway_nofile, START_NOFILE[1])) if a.gateway_nofile else START_NOFILE
    servers, unavailable = start_targets(a, stack, tmp, sim, gw_cpu, nofile)
    org_id, key = create_tenant(servers["kiln"])
    b = Bench(servers, key, load_fn, load_cpu, a.duration, a.warmup, unavailable)
    out = [f"- idle CPU of each gateway: {idle_cpu(servers)}"]
    if "table" in a.sections:
        print("side-by-side table:", flush=True)
        columns = ["direct", *[t for t in a.targets if t != "direct"]]
        rows = table(b, table_workloads(a.protocols, a.modes), a.levels, columns, a.repeat)
        text, notes = report.main_table(rows, columns)
        out = [text, "", *[f"[{i}] {n}" for i, n in enumerate(notes, 1)], *out]
        if "stream" in a.modes:
            print("first token at c=1:", flush=True)
            ttft = first_token(b, a.protocols, columns)
            out += ["", "Time to the first text chunk, c=1, p50 ms (added over direct):", "",
                    *report.first_token_table(ttft), ""]
        out += ["- targets (issue 14):", *[f"  - {t}" for t in report.targets(rows)]]
        out.append("- peak RSS (VmHWM): " + ", ".join(
            f"{report.NAMES[n]} {s.peak_rss_mb():.0f} MiB" for n, s in servers.items() if n != "direct"))
    if "long" in a.sections:
        print("long streams:", flush=True)
        text, _ = report.long_table(long_streams(b, a.protocols, a.long_targets))
        out = [*out, "", "Long streams (CPU of the gateway per output token, one stream at a time):", "", text, ""]
        print("paced streams:", flush=True)
        tokens, delay_ms, conc = PACE
        out += [f"Paced streams (CPU of the gateway per output token, {tokens} tokens a stream, one every "
                f"{delay_ms} ms, {conc} streams at a time: a token a read, as a model server sends them):", "",
                report.paced_table(paced_streams(b, a.protocols, a.long_targets)), ""]
    if "rss" in a.sections:
        print("RSS over time:", flush=True)
        out += report.rss_lines(rss_over_time(b, a.protocols, a.rss_requests, a.rss_concurrency,
                                              10.0 if a.rss_requests >= 200_000 else 2.0))
    if "slow" in a.sections:
        print(f"many slow streams ({a.slow_streams:,}):", flush=True)
        out += report.slow_lines(slow_streams(b, stack, tmp, a.slow_streams, a.slow_protocol, a.server, gw_cpu,
                                              nofile, a.slow_rate, a.slow_tokens, a.slow_body,
                                              a.slow_workers))
    out.append(ledger_line(b, org_id))
    return out


def main() -> int:
    a = parse_args()
    wrk = ensure_wrk() if a.client in ("auto", "wrk") else None
    if a.client == "wrk" and wrk is None:
        raise BenchError("wrk is not installed and could not be installed")
    gw_cpu, load_cpu, pin_note = cpus_for(a.no_pin)
    # the load generator and the simulator hold every slow stream's socket; the gateways do not inherit this
    raise_nofile(2 * a.slow_streams + 4096)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind like Ctrl-C: every process is stopped
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
        if not a.keep:
            stack.callback(shutil.rmtree, tmp, True)  # runs last, after the processes are stopped
        lines = run(a, stack, tmp, run_wrk if wrk else run_aiohttp, (gw_cpu, load_cpu))
    client = f"wrk ({wrk}), 1 thread" if wrk else "asyncio+aiohttp in-process (may itself be the bottleneck at high c)"
    lite = litellm_env.installed()
    print("\n" + "\n".join(lines))
    print(f"- load generator: {client}; {a.duration:g} s per cell after {a.warmup:g} s warm-up; simulator with zero "
          f"delays; one gateway worker (but in `workers`); server: {a.server} (`workers`, `redis`: uvicorn); LiteLLM "
          + (f"{lite['version']} (proxy requirements skipped: {', '.join(lite['skipped']) or 'none'})"  # type: ignore[arg-type]
             if lite else "not installed"))
    print(f"- {pin_note}; 1-min load average before the run: {load_before:.2f} (other work skews the numbers); "
          f"gateway open-file limit {a.gateway_nofile or START_NOFILE[0]:,} asked (at most the hard limit, "
          f"{START_NOFILE[1]:,}, without CAP_SYS_RESOURCE); run took {time.monotonic() - started:.0f} s"
          + (f"\n- logs, configs and database kept in {tmp}" if a.keep else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"\nBENCHMARK FAILED: {exc}\n(--keep keeps every server's log)", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted; all started processes stopped", file=sys.stderr)
        sys.exit(130)

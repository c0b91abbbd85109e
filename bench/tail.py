"""The tail of one client's latency: every request timed, and when the slow ones happen.

wrk at one connection (bench/timed.lua) against the simulator directly, the bare proxy and
Kiln, pinned as in bench/run.py (gateway alone on one CPU, simulator and wrk on the other).
For each: p50, p90, p99, p99.9 and what the proxy adds to the direct call's p50 and p99,
then the gaps between successive slow requests (those at or above the p99). Slow requests
that come at a fixed interval point at a timer in the gateway, not at the machine: that is
how a ledger commit every 0.1 s, sharing the gateway's core with the event loop, was found
(most gaps were 102 ms; see the SQLite store's `_yield_cpu`).

    .venv/bin/python bench/tail.py                      # chat JSON, 8 s per target
    .venv/bin/python bench/tail.py --protocol messages --seconds 20 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import orjson

from load import ensure_wrk
from servers import (START_NOFILE, BenchError, Server, cpus_for, create_tenant, first_upstream_body, forget_requests,
                     http, pinned, start_bare, start_kiln, start_sim)
from workloads import PROTOCOLS, UPSTREAM, make

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--protocol", choices=PROTOCOLS, default="chat")
    p.add_argument("--seconds", type=int, default=8, help="measured seconds per target (default 8)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of direct, bare, Kiln (default 1)")
    p.add_argument("--targets", default="direct,bare,kiln")
    p.add_argument("--no-pin", action="store_true")
    return p.parse_args()


def timed(server: Server, path: str, body: dict, headers: str, seconds: int, cpu: int | None,
          tmp: Path) -> list[tuple[float, float]]:
    """(sent µs, latency µs) of every request of a `seconds` run, after a 2 s warm-up."""
    (tmp / "body.json").write_bytes(orjson.dumps(body))
    (tmp / "requests.tsv").write_text(f"{path}\t{tmp / 'body.json'}\n")
    out = tmp / "latencies.txt"
    env = {**os.environ, "BENCH_POST_LUA": str(HERE / "post.lua"), "BENCH_REQUESTS": str(tmp / "requests.tsv"),
           "BENCH_HEADERS": headers, "BENCH_OUT": str(out)}
    for secs in (2, seconds):
        out.unlink(missing_ok=True)
        cmd = ["wrk", "-t1", "-c1", f"-d{secs}s", "-s", str(HERE / "timed.lua"), server.url]
        run = subprocess.run(pinned(cmd, cpu), env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0 or "Non-2xx" in run.stdout:
            raise BenchError(f"wrk against {server.name} failed: {run.stdout}{run.stderr}")
    rows = [tuple(map(float, line.split())) for line in out.read_text().splitlines() if line]
    return rows  # type: ignore[return-value]


def summary(rows: list[tuple[float, float]]) -> dict[str, float]:
    lat = sorted(latency for _, latency in rows)
    n = len(lat)
    return {"n": n, **{f"p{q:g}": lat[min(n - 1, int(n * q / 100))] for q in (50, 90, 99, 99.9)},
            "wrk p99": wrk_corrected(lat, 99)}


def wrk_corrected(lat: list[float], q: float) -> float:
    """The percentile wrk itself prints (and hands to a script's done()): before reporting it
    corrects for coordinated omission (stats_correct in wrk's stats.c), adding for every latency
    of at least twice the mean interval between requests the samples a client sending on schedule
    would have seen: latency - interval, latency - 2 intervals, ... while above one interval. At
    one connection that makes the p99 a measure of the rare stalls of several milliseconds (the
    p99.9), which is why bench/run.py's c=1 p99 reads higher than this tool's."""
    if not lat:
        return 0.0
    interval = sum(lat) / len(lat)  # one connection: requests back to back
    extra = [m for latency in lat if latency >= 2 * interval
             for m in _steps(latency - interval, interval)]
    merged = sorted(lat + extra)
    return merged[min(len(merged) - 1, int(len(merged) * q / 100))]


def _steps(start: float, interval: float) -> list[float]:
    out = []
    while start > interval:
        out.append(start)
        start -= interval
    return out


def slow_gaps(rows: list[tuple[float, float]], threshold: float) -> Counter[int]:
    """Gaps (ms, rounded to 2) between successive requests at or above `threshold`."""
    slow = [sent for sent, latency in rows if latency >= threshold]
    return Counter(round((b - a) / 2000) * 2 for a, b in zip(slow, slow[1:]))


def main() -> int:
    a = parse_args()
    if ensure_wrk() is None:
        print("wrk is not installed", file=sys.stderr)
        return 2
    gw_cpu, load_cpu, placement = cpus_for(a.no_pin)
    targets = [t for t in ("kiln", "bare", "direct") if t in a.targets.split(",")]
    w = make(a.protocol, "json", False)
    print(f"{a.protocol}/json at c=1, {a.seconds} s per target; {placement}")
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kiln-bench-tail-") as tmp_dir:
        tmp = Path(tmp_dir)
        sim = start_sim(stack, tmp, load_cpu)
        upstream = (UPSTREAM[a.protocol], w.body)  # the chat call Kiln makes for it, once seen
        runs: dict[str, tuple[Server, str, dict, str]] = {}
        for target in targets:
            if target == "kiln":
                kiln = start_kiln(stack, tmp, sim.url, gw_cpu)
                _, key = create_tenant(kiln)
                headers = f"Authorization: Bearer {key}\nx-api-key: {key}"
                forget_requests(sim)
                status, _, raw = http("POST", kiln.url + w.path, w.body, {"Authorization": f"Bearer {key}"})
                if status != 200:
                    raise BenchError(f"Kiln answered {status}: {raw[:300]!r}")
                upstream = (UPSTREAM[a.protocol], first_upstream_body(sim))
                runs[target] = (kiln, w.path, w.body, headers)
            elif upstream[1] is w.body and a.protocol not in ("chat", "completions"):
                print(f"{target}: needs the chat call Kiln makes (add kiln to --targets); skipped")
            elif target == "bare":
                runs[target] = (start_bare(stack, tmp, sim.url, gw_cpu, "uvicorn", START_NOFILE), *upstream, "")
            else:
                runs[target] = (sim, *upstream, "")
        for round_ in range(a.repeat):
            results = {}
            for target in ("direct", "bare", "kiln"):
                if target in runs:
                    rows = timed(*runs[target], a.seconds, load_cpu, tmp)
                    stats = summary(rows)
                    results[target] = {**stats, "gaps": slow_gaps(rows, stats["p99"])}
            report(results, round_)
    return 0


def report(results: dict[str, dict], round_: int) -> None:
    base = results.get("direct")
    print(f"\nround {round_ + 1}")
    print("| target | requests | p50 µs | p90 µs | p99 µs | p99.9 µs | wrk's p99 µs | added p50 µs | added p99 µs |"
          " most common gaps between slow requests (ms × times) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    for target, r in results.items():
        added = (f"{r['p50'] - base['p50']:,.0f} | {r['p99'] - base['p99']:,.0f}" if base and target != "direct"
                 else "– | –")
        gaps = ", ".join(f"{ms} × {n}" for ms, n in r["gaps"].most_common(3))
        print(f"| {target} | {r['n']:,} | {r['p50']:,.0f} | {r['p90']:,.0f} | {r['p99']:,.0f} | {r['p99.9']:,.0f} |"
              f" {r['wrk p99']:,.0f} | {added} | {gaps} |")
    if base and "bare" in results and "kiln" in results:
        ratio = [(results["kiln"][q] - base[q]) / max(results["bare"][q] - base[q], 1.0) for q in ("p50", "p99")]
        wrk = (results["kiln"]["wrk p99"] - base["wrk p99"]) / max(results["bare"]["wrk p99"] - base["wrk p99"], 1.0)
        print(f"Kiln / bare proxy, added latency: p50 {ratio[0]:.2f}×, p99 {ratio[1]:.2f}× (target ≤ 1.3×);"
              f" by wrk's corrected p99 {wrk:.2f}×")


if __name__ == "__main__":
    sys.exit(main())

"""Instructions per request, counted by valgrind: a figure that does not move with the machine's load.

On a shared machine the CPU time of a request moves by a third from run to run; the number of
instructions the gateway executes for it does not. This starts the simulator (natively) and the
gateway under `valgrind --tool=callgrind` (about 50 times slower), warms up, zeroes the counters,
sends --requests requests of one workload at --concurrency, dumps the counters and prints
instructions per request: for Kiln and for the bare proxy, and their ratio (for Responses and
Messages the bare proxy is sent the chat call Kiln made, as in bench/run.py). Use it to judge a
change to the hot path (before/after on the same workload); bench/run.py stays the measure of
throughput and latency.

    .venv/bin/python bench/instructions.py --protocol chat --workload json
    .venv/bin/python bench/instructions.py --protocol messages --workload stream --targets kiln
    .venv/bin/python bench/instructions.py --protocol messages --workload agent --requests 120 --warmup 30
    .venv/bin/python bench/instructions.py --protocol messages --workload paced --requests 40 --warmup 8 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from servers import (ADMIN_KEY, PY, HERE, BenchError, Server, _answers, create_tenant, first_upstream_body,
                     forget_requests, free_port, kiln_config, set_sim_rules, spawn, start_sim, wait_until)
from scaleout import ONE_WORKER, setup_services
from workloads import PROTOCOLS, Workload, agent, make

VALGRIND = ["valgrind", "--tool=callgrind", "--collect-atstart=yes", "--dump-instr=no", "--combine-dumps=yes"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--protocol", choices=PROTOCOLS, default="chat")
    p.add_argument("--workload", choices=("json", "stream", "agent", "paced"), default="json",
                   help="agent: the 60 KB Claude Code / Codex bodies (messages, responses); paced: a stream of "
                        "--tokens tokens, one every --delay-ms (a token a read, as a model server sends them). "
                        "For Responses and Messages the bare proxy is sent the chat body Kiln made of the request")
    p.add_argument("--tokens", type=int, default=100, help="paced: tokens per stream (default 100)")
    p.add_argument("--delay-ms", type=int, default=20, help="paced: milliseconds between tokens (default 20)")
    p.add_argument("--requests", type=int, default=400, help="counted requests per target (default 400)")
    p.add_argument("--warmup", type=int, default=100, help="requests before the counters are zeroed")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--targets", default="bare,kiln", help="bare,kiln (default) or one of them")
    p.add_argument("--setup", default="memory", choices=ONE_WORKER,
                   help="Kiln's database and admission, as in bench/scaleout.py (default memory: SQLite, "
                        "in-process); memory+pg and redis+pg count what Redis admission costs the gateway")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (callgrind dumps for callgrind_annotate)")
    p.add_argument("--cache", action="store_true",
                   help="also simulate the caches (valgrind's model of this CPU's): first-level instruction and "
                        "data misses and last-level misses per request (about twice as slow)")
    return p.parse_args()


def under_valgrind(stack: ExitStack, tmp: Path, name: str, cmd: list[str], env: dict[str, str],
                   cache: bool = False) -> tuple[Server, Path]:
    out = tmp / f"{name}.callgrind"
    valgrind = [*VALGRIND, "--cache-sim=yes"] if cache else VALGRIND
    proc = spawn(stack, [*valgrind, f"--callgrind-out-file={out}", *cmd], tmp / f"{name}.log", env=env)
    return Server(name, "", proc, tmp / f"{name}.log"), out


def start(stack: ExitStack, tmp: Path, target: str, sim_url: str, cache: bool = False,
          setup: str = "memory") -> tuple[Server, Path]:
    import os

    port = free_port()
    if target == "bare":
        cmd = [PY, str(HERE / "bare_proxy.py"), "--upstream", sim_url, "--port", str(port)]
        env = dict(os.environ)
    else:
        config = kiln_config(tmp, [sim_url])
        cmd = [PY, "-m", "kiln", "serve", "--config", str(config), "--port", str(port)]
        env = {**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY, "KILN_CONFIG": str(config), "KILN_PORT": str(port),
               "KILN_DATA_DIR": str(tmp / "kiln-data")}
        env.update(setup_services(stack, setup, f"instr_{os.getpid()}_{setup.replace('+', '_')}"))
    server, out = under_valgrind(stack, tmp, target, cmd, env, cache)
    server.url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(server.url + "/health"), server.proc, server.log, f"{target} under valgrind", 600)
    return server, out


async def drive(url: str, body: dict, headers: dict[str, str], n: int, concurrency: int) -> None:
    left = n

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url, json=body, headers=headers) as resp:
                answer = await resp.read()
                if resp.status != 200:
                    raise BenchError(f"HTTP {resp.status} from {url}: {answer[:500]!r}")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))


def totals(path: Path) -> dict[str, int]:
    """The event totals of a callgrind dump (its `events:` line named, its `totals:` or `summary:` line
    counted): Ir, and with the cache simulation I1mr, ILmr, Dr, D1mr, DLmr, Dw, D1mw, DLmw."""
    text = path.read_text(errors="replace")
    names = re.findall(r"^events:\s+(.+)$", text, re.M)
    found = re.findall(r"^(?:totals|summary):\s+([\d ]+)$", text, re.M)
    if not found or not names:
        raise BenchError(f"no totals in {path}")
    return dict(zip(names[-1].split(), (int(n) for n in found[-1].split())))


def cache_line(per: dict[str, float]) -> str:
    """First-level instruction and data misses and last-level misses, per request."""
    d1 = per.get("D1mr", 0) + per.get("D1mw", 0)
    ll = per.get("ILmr", 0) + per.get("DLmr", 0) + per.get("DLmw", 0)
    return f"I1 misses {per.get('I1mr', 0) / 1e3:.1f} K, D1 misses {d1 / 1e3:.1f} K, LL misses {ll / 1e3:.2f} K"


def measure(stack: ExitStack, tmp: Path, target: str, sim: Server, w: Workload,
            a: argparse.Namespace) -> dict[str, float]:
    """Events per request (Ir, and the cache misses with --cache)."""
    server, out = start(stack, tmp, target, sim.url, a.cache, a.setup)
    headers = {}
    url, body = server.url + w.path, w.body
    if target == "kiln":
        _, key = create_tenant(server)
        headers = {"Authorization": f"Bearer {key}", "x-api-key": key}
        forget_requests(sim)
    elif w.direct is not None:  # what Kiln sent upstream for it (a Responses or Messages request, as chat)
        url, body = server.url + w.upstream_path, w.direct
    asyncio.run(drive(url, body, headers, a.warmup, a.concurrency))
    if target == "kiln" and w.upstream_path != w.path:  # Responses, Messages: the chat call Kiln made
        w.direct = first_upstream_body(sim)
    pid = str(server.proc.pid)
    subprocess.run(["callgrind_control", "--zero", pid], check=True, capture_output=True)
    asyncio.run(drive(url, body, headers, a.requests, a.concurrency))
    time.sleep(1.0)  # what the last requests left (ledger commit) settles
    for old in tmp.glob(f"{out.name}*"):
        old.unlink()
    subprocess.run(["callgrind_control", "--dump", pid], check=True, capture_output=True)
    dumps = sorted(tmp.glob(f"{out.name}*"), key=lambda p: p.stat().st_mtime)
    if not dumps:
        raise BenchError(f"callgrind wrote no dump for {target}")
    return {name: count / a.requests for name, count in totals(dumps[-1]).items()}


def main() -> int:
    a = parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (with callgrind_control) is not installed", file=sys.stderr)
        return 2
    targets = [t for t in a.targets.split(",") if t]
    results: dict[str, dict[str, float]] = {}
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kiln-instructions-"))
        if a.keep:
            print(f"callgrind dumps and logs in {tmp}")
        else:
            stack.callback(shutil.rmtree, tmp, True)
        sim = start_sim(stack, tmp, None)
        if a.workload == "agent":
            w = agent(a.protocol)
        elif a.workload == "paced":
            w = make(a.protocol, "paced", True, tokens=a.tokens, delay_ms=a.delay_ms)
        else:
            w = make(a.protocol, a.workload, a.workload == "stream")
        if w.rules:
            set_sim_rules(sim, w.rules)
        for target in sorted(targets, key=lambda t: t != "kiln"):  # Kiln first: the chat body it makes
            per = results[target] = measure(stack, tmp, target, sim, w, a)
            extra = f"; {cache_line(per)}" if a.cache else ""
            token = f" ({per['Ir'] / a.tokens / 1e3:.1f} K a token)" if a.workload == "paced" else ""
            where = f" ({a.setup})" if target == "kiln" and a.setup != "memory" else ""
            print(f"{a.protocol}/{a.workload} {target}{where}: {per['Ir'] / 1e6:.3f} M instructions per request"
                  f"{token}{extra}",
                  flush=True)
    if "bare" in results and "kiln" in results:
        kiln, bare = results["kiln"], results["bare"]
        print(f"Kiln / bare proxy: {kiln['Ir'] / bare['Ir']:.2f}x the instructions per request")
        if a.cache:
            for name in ("I1mr", "D1mr", "DLmr"):
                if bare.get(name):
                    print(f"Kiln / bare proxy: {kiln[name] / bare[name]:.2f}x the {name} per request")
    return 0


if __name__ == "__main__":
    sys.exit(main())

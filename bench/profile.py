"""Where the gateway's time goes: py-spy samples Kiln while wrk drives one workload through it.

Starts the simulator and Kiln like bench/run.py (pinned, same config), checks the workload
once, then records `py-spy record` of the gateway for --duration seconds under load and
writes a speedscope file (open it at https://www.speedscope.app) or a flamegraph SVG. For
speedscope it also prints the functions with the most samples, own and inclusive.

    .venv/bin/python bench/profile.py --protocol messages --workload stream --concurrency 64
    .venv/bin/python bench/profile.py --protocol responses --workload long --tokens 32768 --format flamegraph
    .venv/bin/python bench/profile.py --target bare     # the bare proxy under the same load, to compare
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from load import ensure_wrk, run_aiohttp, run_wrk
from measure import Bench, prepare
from scaleout import ONE_WORKER, setup_services
from servers import START_NOFILE, BenchError, cpus_for, create_tenant, start_bare, start_kiln, start_sim
from workloads import PROTOCOLS, agent, make


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--protocol", choices=PROTOCOLS, default="chat")
    p.add_argument("--workload", choices=("json", "stream", "agent", "long"), default="json",
                   help="json / stream: 20 tokens; agent: the 60 KB bodies (messages, responses); long: --tokens")
    p.add_argument("--tokens", type=int, default=8192, help="reply length of the long workload (default 8192)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sampling (default 10)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    p.add_argument("--format", choices=("speedscope", "flamegraph", "raw"), default="speedscope")
    p.add_argument("--output", help="file to write (default kiln-PROTOCOL-WORKLOAD-cC.<ext> in the current dir)")
    p.add_argument("--native", action="store_true", help="include C frames (py-spy --native)")
    p.add_argument("--gil", action="store_true", help="only samples holding the GIL (py-spy --gil)")
    p.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn")
    p.add_argument("--target", choices=("kiln", "bare"), default="kiln",
                   help="the process to sample: Kiln, or the bare proxy (bench/bare_proxy.py) on the same load")
    p.add_argument("--setup", default="memory", choices=ONE_WORKER,
                   help="Kiln's database and admission, as in bench/scaleout.py (default memory: SQLite, in-process)")
    p.add_argument("--top", type=int, default=20, help="functions to list (speedscope only; default 20)")
    p.add_argument("--no-pin", action="store_true")
    a = p.parse_args()
    if a.workload == "agent" and a.protocol not in ("messages", "responses"):
        p.error("--workload agent needs --protocol messages or responses")
    return a


def summary(path: Path, top: int) -> str:
    """The functions with the most samples in a speedscope file: own time, and inclusive."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    own: Counter[int] = Counter()
    inclusive: Counter[int] = Counter()
    total = 0
    for profile in data["profiles"]:
        for stack in profile["samples"]:  # every sample weighs 1/rate: count them
            weight = 1
            total += weight
            if stack:
                own[stack[-1]] += weight
            for frame in set(stack):
                inclusive[frame] += weight

    def name(i: int) -> str:
        f = frames[i]
        where = str(f.get("file", "")).split("site-packages/")[-1].split("/src/")[-1]
        return f"{f['name']} ({where}:{f.get('line')})"

    lines = [f"{total:,} samples on CPU (all threads)", "", "own time:"]
    lines += [f"  {w * 100 / total:5.1f}%  {name(i)}" for i, w in own.most_common(top)]
    lines += ["", "inclusive (without the frames under every sample: the server's entry points):"]
    inner = [(i, w) for i, w in inclusive.most_common() if w < 0.98 * total][:top]
    lines += [f"  {w * 100 / total:5.1f}%  {name(i)}" for i, w in inner]
    return "\n".join(lines)


def main() -> int:
    a = parse_args()
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        raise BenchError("py-spy is not installed: pip install -e '.[bench]'")
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    wrk = ensure_wrk()
    gw_cpu, load_cpu, pin_note = cpus_for(a.no_pin)
    ext = {"speedscope": "speedscope.json", "flamegraph": "svg", "raw": "txt"}[a.format]
    out = Path(a.output or f"kiln-{a.protocol}-{a.workload}-c{a.concurrency}.{ext}").resolve()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="kiln-profile-"))
        stack.callback(shutil.rmtree, tmp, True)
        sim = start_sim(stack, tmp, load_cpu)
        env = setup_services(stack, a.setup, f"profile_{os.getpid()}")
        kiln = start_kiln(stack, tmp, sim.url, gw_cpu, a.server, START_NOFILE, env=env)
        _, key = create_tenant(kiln)
        servers = {"direct": sim, "kiln": kiln}
        if a.target == "bare":  # Kiln stays up, idle: its upstream call is the bare proxy's request
            servers["bare"] = start_bare(stack, tmp, sim.url, gw_cpu, a.server, START_NOFILE)
        b = Bench(servers, key, run_wrk if wrk else run_aiohttp, load_cpu, a.duration, 0)
        if a.workload == "agent":
            w = agent(a.protocol)
        elif a.workload == "long":
            w = make(a.protocol, f"long-{a.tokens}", True, tokens=a.tokens)
        else:
            w = make(a.protocol, a.workload, a.workload == "stream")
        load = prepare(b, w, [a.target])[a.target]
        assert not isinstance(load, str)
        b.run(load, a.concurrency, 1.0, load_cpu)  # warm up
        result: dict[str, object] = {}
        driver = threading.Thread(target=lambda: result.update(r=b.run(load, a.concurrency, a.duration + 2, load_cpu)))
        driver.start()
        cmd = [spy, "record", "--pid", str(servers[a.target].proc.pid), "--duration", str(round(a.duration)), "--rate",
               str(a.rate), "--format", a.format, "--output", str(out)]
        cmd += ["--subprocesses"] if a.server == "granian" else []
        cmd += ["--native"] if a.native else []
        cmd += ["--gil"] if a.gil else []
        spied = subprocess.run(cmd, capture_output=True, text=True, check=False)
        driver.join()
        if spied.returncode != 0 or not out.exists():
            raise BenchError(f"py-spy failed ({spied.returncode}): {spied.stdout}{spied.stderr}")
    res = result.get("r")
    print(f"profile of {'Kiln' if a.target == 'kiln' else 'the bare proxy'} ({a.server}) under {w.key} at c={a.concurrency}: {out}")
    if res is not None:
        print(f"load: {res.rps:,.0f} rps, p50 {res.p50_ms:.2f} ms, {res.errors} errors; {pin_note}")  # type: ignore[attr-defined]
    if a.format == "speedscope":
        print(summary(out, a.top))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"\nPROFILE FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)

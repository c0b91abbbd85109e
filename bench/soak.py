"""Memory checks: many slow streams held at once, and RSS sampled over a long run.

The slow streams get a gateway of their own (fresh, so its peak RSS is theirs), started with
the open-file limit this benchmark was started with: if Kiln cannot hold N streams for lack
of descriptors, that is the finding; chat and completions streams are then held by a fresh
bare proxy too, the floor for a Python gateway. RSS over time is Kiln's only.
"""

from __future__ import annotations

import json
import math
import secrets
import subprocess
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from load import Load
from scaleout import known_everywhere, own_services, pg_problem, redis_problem
from measure import Bench, prepare
from servers import (PY, BenchError, Server, create_tenant, http, pinned, set_sim_rules, start_bare, start_kiln, stop,
                     usage_events)
from workloads import AGENT_TAG, MODEL, Workload, agent, make, sim_control

HERE = Path(__file__).resolve().parent


@dataclass
class SlowResult:
    n: int
    completed: int
    problems: dict[str, int]
    idle_rss_mb: float
    peak_rss_mb: float
    upstream_peak: int  # most streams the simulator held at once
    seconds: float
    fd_exhausted: bool  # the gateway's log says "Too many open files"
    protocol: str
    metered: int  # usage events for the slow streams in the ledger
    open_s: float  # time to open them all
    peak_open: int  # most streams the load generator had open at once
    peak_fds: int  # most file descriptors the gateway had open
    fd_limit: int  # the gateway's open-file limit
    body: str = "small"  # small | agent (the 60 KB agent bodies)
    workers: int = 1  # Kiln's worker processes (RSS summed over them and their parent)
    bare: SlowResult | None = None  # the same streams through the bare proxy (chat and completions)

    @property
    def kb_per_stream(self) -> float:
        return (self.peak_rss_mb - self.idle_rss_mb) * 1024 / max(self.peak_open, 1)


def slow_workload(protocol: str, body: str, tokens: int) -> Workload:
    """One token a second for `tokens` seconds; `agent`: the 60 KB agent body (messages, responses)."""
    if body != "agent":
        return make(protocol, "slow", True, tokens=tokens, delay_ms=1000)
    if protocol not in ("messages", "responses"):
        raise BenchError("--slow-body agent: the agent bodies are Messages and Responses requests")
    w = agent(protocol)
    w.name, w.tokens, w.rules = "slow-agent", tokens, [{"when": AGENT_TAG, "sim": sim_control(tokens, 1000)}]
    return w


def slow_streams(b: Bench, stack: ExitStack, tmp: Path, n: int, protocol: str, server: str,
                 gw_cpu: int | None, nofile: tuple[int, int], rate: float = 250.0, tokens: int = 0,
                 body: str = "small", workers: int = 1) -> SlowResult:
    """N streams of one token a second through a fresh Kiln, long enough to be all open at once,
    then (chat and completions, one worker) the same through a fresh bare proxy.

    Opening a stream costs the gateway about a millisecond of CPU (more on a busy machine), so
    each stream lasts `tokens` seconds (default: N / 100 + 15, i.e. the last one opens before the
    first one ends as long as the gateway opens 100 a second)."""
    kiln_tmp = tmp / "slow"
    kiln_tmp.mkdir()
    kiln = start_kiln(stack, kiln_tmp, b.sim.url, gw_cpu, server, nofile, workers=workers,
                      env=_shared_env(stack) if workers > 1 else None)
    org_id, key = create_tenant(kiln)
    known_everywhere(kiln, key, workers)
    tokens = tokens or math.ceil(n / 100) + 15
    w = slow_workload(protocol, body, tokens)
    quick = Bench({"direct": b.sim, "kiln": kiln}, key, b.run, b.load_cpu, b.duration, b.warmup)
    fast = make(protocol, "slow-check", True)  # check the path with an instant reply first
    prepare(quick, fast, ["kiln"])
    set_sim_rules(b.sim, w.rules)
    path, request = quick.request("kiln", w)
    result = _slow_run(b, kiln, kiln_tmp, path, request, quick.headers("kiln", w), protocol, n, rate, tokens)
    events, deadline = 0, time.monotonic() + 30  # metering of the last streams may lag
    while (events := usage_events(kiln, org_id)) < result.completed + quick.kiln_sent and time.monotonic() < deadline:
        time.sleep(0.5)
    result.metered, result.body, result.workers = events - quick.kiln_sent, body, workers
    stop(kiln.proc)  # free the gateway's core for what follows
    if protocol in ("chat", "completions") and body == "small" and workers == 1:
        bare_tmp = tmp / "slow-bare"
        bare_tmp.mkdir()
        bare = start_bare(stack, bare_tmp, b.sim.url, gw_cpu, server, nofile)
        direct = {**request, "model": (fast.direct or {}).get("model", MODEL)}  # the backend's name for it
        result.bare = _slow_run(b, bare, bare_tmp, w.upstream_path, direct, {}, protocol, n, rate, tokens)
        stop(bare.proc)
    return result


def _shared_env(stack: ExitStack) -> dict[str, str]:
    """What several workers need: PostgreSQL and Redis, with a schema and key prefix of their own."""
    for service, problem in (("PostgreSQL", pg_problem()), ("Redis", redis_problem())):
        if problem:
            raise BenchError(f"--slow-workers needs {service}: {problem}")
    return own_services(stack, f"slow_{secrets.token_hex(4)}", pg=True, redis=True)


def _slow_run(b: Bench, gw: Server, tmp: Path, path: str, body: dict[str, Any], headers: dict[str, str],
              protocol: str, n: int, rate: float, tokens: int) -> SlowResult:
    """The slow-stream client against one gateway; its RSS idle and at the peak."""
    body_file = tmp / "body.json"
    body_file.write_text(json.dumps(body))
    http("POST", b.sim.url + "/sim/stats/reset")
    idle, fd_limit = gw.rss_mb(), gw.nofile_limit()
    cmd = [PY, str(HERE / "slow_client.py"), "--url", gw.url, "--path", path, "--body-file", str(body_file),
           "--protocol", protocol, "--tokens", str(tokens), "--n", str(n), "--rate", str(rate),
           "--timeout", str(tokens * 10 + 120), *[x for k, v in headers.items() for x in ("--header", f"{k}: {v}")]]
    peak = _Sampler(gw)
    start = time.monotonic()
    with peak:
        out = subprocess.run(pinned(cmd, b.load_cpu), capture_output=True, text=True, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("SLOW ")), None)
    if line is None:
        raise BenchError(f"slow-stream client failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")
    summary = json.loads(line[5:])
    stats = json.loads(http("GET", b.sim.url + "/sim/stats")[2])
    return SlowResult(n, int(summary["completed"]), summary["problems"], idle, max(peak.peak, gw.peak_rss_mb()),
                      int(stats.get("max_in_flight", 0)), time.monotonic() - start,
                      "Too many open files" in gw.log.read_text(errors="replace"), protocol, 0,
                      float(summary["open_s"]), int(summary["peak_open"]), peak.peak_fds, fd_limit)


class _Sampler:
    """Samples a server's RSS every half second while in the `with` block; keeps the peak."""

    def __init__(self, server: Server, every: float = 0.5) -> None:
        self.server, self.every, self.peak, self.peak_fds = server, every, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            if self.server.alive():
                self.peak = max(self.peak, self.server.rss_mb())
                self.peak_fds = max(self.peak_fds, self.server.open_files())

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


# Admission's rate windows hold each request of the last minute (an exact sliding window), so
# memory grows for the first minute at any rate, then stays: the baseline is taken after that.
WARM_S = 90.0


@dataclass
class RssResult:
    samples: list[tuple[int, float]] = field(default_factory=list)  # (requests so far, RSS MiB)
    requests: int = 0
    seconds: float = 0.0
    concurrency: int = 0
    warm_requests: int = 0  # requests done when the rate windows had been full for a while (WARM_S)

    @property
    def start(self) -> int:
        """Where the baseline is taken: after 10% of the requests and after WARM_S seconds."""
        return max(int(self.requests * 0.10), self.warm_requests)

    @property
    def baseline(self) -> float:
        """RSS once pools, caches and the one-minute rate windows have filled."""
        return next((rss for done, rss in self.samples if done >= self.start), self.samples[-1][1])

    @property
    def max_deviation(self) -> float:
        """Largest relative distance from the baseline of any sample after it."""
        base, target = self.baseline, self.start
        later = [rss for done, rss in self.samples if done >= target]
        return max(abs(rss - base) / base for rss in later) if later and base else 0.0


def rss_over_time(b: Bench, protocols: list[str], total: int, conc: int, slice_s: float) -> RssResult:
    """Every protocol, JSON and streaming, in turn through Kiln until `total` requests; RSS after each slice."""
    kiln = b.servers["kiln"]
    requests: list[tuple[str, bytes]] = []
    headers: dict[str, str] = {}
    for protocol in protocols:
        for mode in ("json", "stream"):
            load = prepare(b, make(protocol, mode, mode == "stream"), ["kiln"])["kiln"]
            assert isinstance(load, Load)
            requests += load.requests
            headers.update(load.headers)  # one key; anthropic-version is harmless elsewhere
    mixed = Load(kiln.url, requests, headers)
    out = RssResult(concurrency=conc, samples=[(0, kiln.rss_mb())])
    start = time.monotonic()
    while out.requests < total:
        res = b.run(mixed, conc, slice_s, b.load_cpu)
        if res.errors:
            raise BenchError(f"RSS run: {res.errors} failed requests through Kiln\n{kiln.log_tail(2000)}")
        out.requests += res.requests
        b.kiln_sent += res.requests
        b.kiln_slack += conc
        out.samples.append((out.requests, kiln.rss_mb()))
        if not out.warm_requests and time.monotonic() - start >= WARM_S:
            out.warm_requests = out.requests
        if len(out.samples) % 10 == 0 or out.requests >= total:
            print(f"  RSS after {out.requests:,} requests: {out.samples[-1][1]:.1f} MiB", flush=True)
    out.seconds = time.monotonic() - start
    return out

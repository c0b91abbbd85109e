"""Running cells: one workload against one target at one concurrency, after a warm-up.

Targets: `direct` (the simulator, sent the chat call Kiln makes for the workload), `bare`
(the bare proxy, sent that same chat call), `kiln` and `litellm` (sent the workload's own
protocol). Each workload is checked once through every target before it is measured; a
target that cannot serve it (LiteLLM) is "n/a" with the reason.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from http.client import HTTPConnection
from typing import Any, Callable
from urllib.parse import urlsplit

from load import Load, Result
from servers import (LITELLM_KEY, BenchError, Server, first_upstream_body, forget_requests, http,
                     set_sim_rules, settle, usage_events)
from workloads import Workload, check, make, sse_events, text_deltas

TARGETS = ("direct", "bare", "kiln", "litellm")
NAMES = {"direct": "direct", "bare": "bare proxy", "kiln": "Kiln", "litellm": "LiteLLM"}
LONG_TOKENS = (20, 8192, 32768)
PACE = (100, 5, 32)  # paced streams: tokens, ms between two, streams at a time (6,400 tokens a second)
Cell = dict[str, "Result | str"]  # target -> result, or why it has none


@dataclass
class Bench:
    """What every cell needs: the servers, Kiln's key, the load generator and its CPU."""

    servers: dict[str, Server]  # target -> server ("direct" is the simulator)
    key: str  # Kiln API key
    run: Callable[..., Result]  # run_wrk or run_aiohttp
    load_cpu: int | None
    duration: float
    warmup: float
    unavailable: dict[str, str] = field(default_factory=dict)  # target -> why it is not running
    kiln_sent: int = 0  # requests Kiln completed (for the ledger check)
    kiln_slack: int = 0  # requests possibly cut off at run ends (metered as cancelled)
    notes: list[str] = field(default_factory=list)

    @property
    def sim(self) -> Server:
        return self.servers["direct"]

    def headers(self, target: str, w: Workload) -> dict[str, str]:
        token = {"kiln": self.key, "litellm": LITELLM_KEY}.get(target)
        out = {"Authorization": f"Bearer {token}"} if token else {}
        if w.protocol == "messages" and token:
            out["anthropic-version"] = "2023-06-01"
        return out

    def request(self, target: str, w: Workload) -> tuple[str, dict[str, Any]]:
        """(path, body) this target is sent for `w`."""
        if target in ("direct", "bare"):
            assert w.direct is not None, "prepare() first"
            return w.upstream_path, w.direct
        return w.path, w.body


def prepare(b: Bench, w: Workload, targets: list[str]) -> dict[str, Load | str]:
    """Check `w` once through every target; returns each target's load, or why it has none.

    Through Kiln first: the chat call Kiln then made upstream becomes the direct body.
    """
    if w.rules:
        set_sim_rules(b.sim, w.rules)
    out: dict[str, Load | str] = {}
    for target in ["kiln", *[t for t in targets if t != "kiln"]]:
        if target in b.unavailable:
            out[target] = b.unavailable[target]
            continue
        server = b.servers[target]
        path, body = b.request(target, w)
        headers = b.headers(target, w)
        if target == "kiln":
            forget_requests(b.sim)
        try:
            status, _, raw = http("POST", server.url + path, body, headers, timeout=120)
        except OSError as exc:  # refused, reset, timed out
            status, raw = 0, f"{type(exc).__name__}: {exc}".encode()
        if target in ("direct", "bare"):  # the chat call may stream where the client did not (Messages)
            problem = check(_upstream_protocol(w), bool(body.get("stream")), w.tokens, status, raw)
        else:
            problem = check(w.protocol, w.stream, w.tokens, status, raw)
        if target == "kiln":
            if problem:
                raise BenchError(f"{w.key} through Kiln: {problem}")
            b.kiln_sent += 1
            w.direct = first_upstream_body(b.sim)
        if problem:
            if target == "litellm":
                out[target] = f"LiteLLM cannot serve {w.key}: {problem[:200]}"
                continue
            raise BenchError(f"{w.key} via {target}: {problem}")
        out[target] = Load(server.url, [(path, json.dumps(body).encode())], headers)
    return out


def _upstream_protocol(w: Workload) -> str:
    return "completions" if w.protocol == "completions" else "chat"


def measure(b: Bench, target: str, load: Load, conc: int, what: str, seconds: float | None = None) -> Result:
    """A warm-up, then a measured run with the target's CPU time per completed request."""
    server = b.servers[target]
    seconds = b.duration if seconds is None else seconds
    runs = []
    if b.warmup > 0:
        runs.append(b.run(load, conc, b.warmup, b.load_cpu))
    before = server.cpu_seconds()
    res = b.run(load, conc, seconds, b.load_cpu)
    res.cpu_us = (server.cpu_seconds() - before) * 1e6 / max(res.requests, 1)
    runs.append(res)
    settle(server)
    for r in runs:
        if r.errors and target != "litellm":
            raise BenchError(f"{what} via {target}: {r.errors} failed requests (non-2xx, socket errors or timeouts)"
                             f"\n{server.log_tail(2000)}")
        if target == "kiln":
            b.kiln_sent += r.requests
            b.kiln_slack += conc
    if not server.alive():
        raise BenchError(f"{target} died during {what}:\n{server.log_tail()}")
    return res


def ledger_line(b: Bench, org_id: str, what: str = "") -> str:
    """The usage ledger must hold one event per request Kiln completed (plus at most the requests
    cut off at the end of a cell, metered as cancelled); raises BenchError otherwise."""
    deadline = time.monotonic() + 10  # cut-off requests are metered late
    while (events := usage_events(b.servers["kiln"], org_id)) < b.kiln_sent and time.monotonic() < deadline:
        time.sleep(0.2)
    ok = b.kiln_sent <= events <= b.kiln_sent + b.kiln_slack
    line = (f"- usage ledger{what}: {events:,} events for {b.kiln_sent:,} requests Kiln completed "
            f"(+ up to {b.kiln_slack:,} cut off at run ends): {'OK' if ok else 'MISMATCH'}")
    if not ok:
        raise BenchError(line)
    return line


def table(b: Bench, workloads: list[Workload], levels: list[int], targets: list[str], repeat: int = 1
          ) -> list[tuple[Workload, int, Cell]]:
    """The side-by-side cells: every workload at every concurrency through every target.

    With `repeat` > 1 the targets take turns that many times and each keeps its best run
    (highest rps): on a shared machine, the run least disturbed by other work. Kiln runs right
    after the bare proxy in each turn, and its ratios to that run are kept too (`paired_rps`,
    `paired_cpu`): this virtual machine's speed drifts by up to half within minutes, so two best
    runs may come from different spells while a pair shares one.
    """
    rows = []
    for w in workloads:
        loads = prepare(b, w, targets)
        for c in levels:
            cell: Cell = {}
            paired_rps: list[float] = []
            paired_cpu: list[float] = []
            for _ in range(repeat):
                last: dict[str, Result] = {}
                for target in targets:
                    load = loads[target]
                    if isinstance(load, str):
                        cell[target] = load
                        continue
                    res = measure(b, target, load, c, f"{w.key} c={c}")
                    best = cell.get(target)
                    if res.errors:
                        cell[target] = f"{NAMES.get(target, target)}: {res.errors} failed requests at c={c}"
                    elif not res.requests:
                        cell[target] = f"no request completed within {b.duration:g} s (raise --duration)"
                    else:
                        last[target] = res
                        if not isinstance(best, Result) or res.rps > best.rps:
                            cell[target] = res
                bare, kiln = last.get("bare"), last.get("kiln")
                if bare and kiln and kiln.cpu_us > 0:
                    paired_rps.append(kiln.rps / bare.rps)
                    paired_cpu.append(bare.cpu_us / kiln.cpu_us)
            kiln_best = cell.get("kiln")
            if repeat > 1 and isinstance(kiln_best, Result):
                kiln_best.paired_rps, kiln_best.paired_cpu = paired_rps, paired_cpu
            rows.append((w, c, cell))
            line = ", ".join(f"{t} {r.rps:,.0f}" if isinstance(r, Result) else f"{t} n/a" for t, r in cell.items())
            print(f"  {w.key:22} c={c:<3} {line} rps", flush=True)
    return rows


@dataclass
class LongRow:
    protocol: str
    target: str
    tokens: int
    streams: int
    cpu_ms_per_stream: float

    @property
    def cpu_us_per_token(self) -> float:
        return self.cpu_ms_per_stream * 1000 / self.tokens


def long_streams(b: Bench, protocols: list[str], targets: list[str], lengths: tuple[int, ...] = LONG_TOKENS
                 ) -> list[LongRow]:
    """Gateway CPU per stream of 20, 8k and 32k output tokens, one stream at a time."""
    rows = []
    for protocol in protocols:
        for n in lengths:
            w = make(protocol, f"long-{n}", True, tokens=n)
            loads = prepare(b, w, targets)
            for target in targets:
                load = loads[target]
                if isinstance(load, str):
                    continue
                # at least ~3 s of streams; long ones take a while each
                res = measure(b, target, load, 1, w.key, seconds=max(b.duration, 3.0))
                rows.append(LongRow(protocol, target, n, res.requests, res.cpu_us / 1000))
                print(f"  {w.key:22} {target:6} {res.requests:5} streams, {res.cpu_us / 1000:8.2f} ms CPU/stream, "
                      f"{res.cpu_us / n:7.2f} µs/token", flush=True)
    return rows


@dataclass
class PacedRow:
    protocol: str
    target: str
    streams: int
    cpu_us_per_token: float


def paced_streams(b: Bench, protocols: list[str], targets: list[str], tokens: int = PACE[0], delay_ms: int = PACE[1],
                  concurrency: int = PACE[2]) -> list[PacedRow]:
    """Gateway CPU per output token at a model server's pace: a token every `delay_ms` per stream,
    so each read holds one chunk, as in real use (the zero-delay cells batch a whole stream into a
    read or two). Streams cut at the end of a cell count their CPU but not their tokens: both
    targets alike, about a tenth more per token than a whole stream costs."""
    rows = []
    for protocol in protocols:
        w = make(protocol, f"paced-{tokens}", True, tokens=tokens, delay_ms=delay_ms)
        loads = prepare(b, w, targets)
        for target in targets:
            load = loads[target]
            if isinstance(load, str):
                continue
            res = measure(b, target, load, concurrency, w.key, seconds=max(b.duration, 5.0))
            rows.append(PacedRow(protocol, target, res.requests, res.cpu_us / tokens))
            print(f"  {w.key:22} {target:6} {res.requests:5} streams, {res.cpu_us / tokens:7.2f} µs/token", flush=True)
    return rows


def first_token(b: Bench, protocols: list[str], targets: list[str], n: int = 30) -> dict[str, dict[str, float | str]]:
    """Time to the first text chunk at c=1, p50 ms per protocol and target.

    The simulator sends the first token at once and the next four 20 ms apart, so the first
    chunk cannot ride along with the rest of the stream: what is measured is how long each
    target takes to pass the first token on. One sequential keep-alive connection per target.
    """
    out: dict[str, dict[str, float | str]] = {}
    for protocol in protocols:
        w = make(protocol, "first-token", True, tokens=5, delay_ms=20)
        loads = prepare(b, w, targets)
        row: dict[str, float | str] = {}
        for target in targets:
            load = loads[target]
            if isinstance(load, str):
                row[target] = load
                continue
            kind = w.protocol if target in ("kiln", "litellm") else _upstream_protocol(w)
            row[target] = _first_token_p50(load, kind, n, b.load_cpu)
            b.kiln_sent += n if target == "kiln" else 0
        out[protocol] = row
        print(f"  first token {protocol:12} " + ", ".join(
            f"{t} {v:.2f} ms" if isinstance(v, float) else f"{t} n/a" for t, v in row.items()), flush=True)
    return out


def _first_token_p50(load: Load, protocol: str, n: int, cpu: int | None) -> float:
    before = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    url = urlsplit(load.url)
    conn = HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=60)
    path, body = load.requests[0]
    times = []
    try:
        for _ in range(n):
            start = time.perf_counter()
            conn.request("POST", path, body, {"Content-Type": "application/json", **load.headers})
            resp = conn.getresponse()
            seen, first = b"", None
            while chunk := resp.read1(65536):
                seen += chunk
                if first is None and b"\n" in chunk and text_deltas(protocol, sse_events(seen)[0]):
                    first = time.perf_counter() - start
            if resp.status != 200 or first is None:
                raise BenchError(f"first-token probe: HTTP {resp.status}, no text chunk: {seen[:300]!r}")
            times.append(first)
    finally:
        conn.close()
        os.sched_setaffinity(0, before)
    times.sort()
    return times[len(times) // 2] * 1000

"""Where a streamed request's translation goes, in process: each protocol's translator per phase.

`bench/run.py` says what a stream costs in the gateway; this says which part of it is the
translator's, and which part of that: the request's mapping, the SSE parse of the backend's
reads, the chunks (runs of text deltas and the chunks read alone, as `Gateway._forward` takes
them) and the end (`finish`). It asks the simulator once for each protocol's backend stream
(the chat call Kiln makes of the workload), then times each phase alone in this process, best
of --repeat rounds of --iterations translators. The bare proxy does none of this: it forwards
the backend's bytes. Wall time on a quiet machine: compare protocols and versions within a run.

    .venv/bin/python bench/translators.py
    .venv/bin/python bench/translators.py --protocols messages --reads 20 --tokens 100
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from contextlib import ExitStack
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

import orjson

from servers import PY, http, set_sim_rules, start_sim
from workloads import MODEL, PATHS, PROTOCOLS, make

from kiln.app import METERED
from kiln.catalog import Backend, Capabilities, Catalog, Model
from kiln.core.money import Prices
from kiln.protocols.base import Context, Translator
from kiln.protocols.reasoning import ReasoningSeal
from kiln.upstream import SSEParser

PHASES = ("request", "parse", "chunks", "finish")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--protocols", default=",".join(PROTOCOLS))
    p.add_argument("--tokens", type=int, default=20, help="text tokens in the reply (default 20, the table's)")
    p.add_argument("--reads", type=int, default=2,
                   help="reads the backend stream comes in, cut at equal sizes (default 2: the zero-delay "
                        "simulator's 20 tokens at c=64); 0: an event a read, as a model server paces them")
    p.add_argument("--iterations", type=int, default=2000, help="translators per round (default 2000)")
    p.add_argument("--repeat", type=int, default=5, help="rounds; the best is reported (default 5)")
    return p.parse_args()


def context(sim_url: str) -> Context:
    model = Model(MODEL, [Backend(sim_url + "/v1", MODEL)], Prices(Decimal(1), Decimal(1), Decimal(2)),
                  131072, 65536, Capabilities())
    return Context(Catalog([model]), ReasoningSeal(b"k" * 32))


def backend_stream(ctx: Context, make_tr: Callable[[Context], Translator], body: bytes, sim_url: str) -> bytes:
    """The simulator's answer to the chat call the translator makes of `body`."""
    call = make_tr(ctx).request(orjson.loads(body))
    status, _, raw = http("POST", sim_url + "/v1" + call.path, orjson.loads(call.encode(MODEL)))
    if status != 200:
        raise SystemExit(f"the simulator answered {status}: {raw[:200]!r}")
    return raw


def cut(raw: bytes, reads: int) -> list[bytes]:
    """`raw` in `reads` pieces of about equal size, or (0) an event a piece."""
    if reads <= 0:
        return [event + b"\n\n" for event in raw.split(b"\n\n") if event]
    size = -(-len(raw) // reads)
    return [raw[i:i + size] for i in range(0, len(raw), size)]


def drive(tr: Translator, batches: list[list[bytes]]) -> Any:
    """The chunks as `Gateway._forward` takes them: runs where the translator offers them, one
    chunk at a time otherwise; the last usage."""
    usage = None
    for batch in batches:
        i, n = 0, len(batch)
        while i < n:
            run = tr.chunks(batch, i, 1 << 30) if n - i > 1 else None
            if run is not None:
                usage = run[1] or usage
                i += run[3]
                continue
            _, reported, _, done = tr.chunk(batch[i])
            usage = reported or usage
            i += 1
            if done:
                return usage
    return usage


def best(work: Callable[[], None], repeat: int) -> float:
    """The fastest of `repeat` rounds, in seconds; no cyclic collection inside a round (as in the
    gateway, which runs without one per request)."""
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
        finally:
            gc.enable()
    return min(times)


def measure(ctx: Context, make_tr: Callable[[Context], Translator], body: bytes, reads: list[bytes],
            n: int, repeat: int) -> dict[str, float]:
    """Microseconds per request of each phase (each timed on its own over `n` fresh translators)."""
    def fresh() -> list[Translator]:
        made = [make_tr(ctx) for _ in range(n)]
        for tr in made:
            tr.request(orjson.loads(body))
        return made

    def parsed() -> list[list[bytes]]:
        parser = SSEParser(1 << 20)
        return [parser.feed(piece) for piece in reads]

    batches = parsed()
    out = {"request": best(lambda: [make_tr(ctx).request(orjson.loads(body)) for _ in range(n)], repeat),
           "parse": best(lambda: [parsed() for _ in range(n)], repeat)}
    times = []
    for _ in range(repeat):
        trs = fresh()
        times.append(best(lambda: [drive(tr, batches) for tr in trs], 1))
    out["chunks"] = min(times)
    times = []
    for _ in range(repeat):  # finish() is called once per translator: a fresh set each round
        trs = fresh()
        usages = [drive(tr, batches) for tr in trs]
        times.append(best(lambda: [tr.finish(u, 1234) for tr, u in zip(trs, usages)], 1))
    out["finish"] = min(times)
    return {k: v / n * 1e6 for k, v in out.items()}


def main() -> int:
    args = parse_args()
    protocols = [p for p in args.protocols.split(",") if p]
    rows = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kiln-translators-") as tmp:
        sim = start_sim(stack, Path(tmp), None)
        ctx = context(sim.url)
        for protocol in protocols:
            workload = make(protocol, "stream", True, tokens=args.tokens)
            if workload.rules:
                set_sim_rules(sim, workload.rules)
            body = orjson.dumps(workload.body)
            make_tr = METERED[PATHS[protocol]]
            raw = backend_stream(ctx, make_tr, body, sim.url)
            reads = cut(raw, args.reads)
            times = measure(ctx, make_tr, body, reads, args.iterations, args.repeat)
            rows.append((protocol, len(raw), len(reads), times))
    print(f"Translator time per streamed request, µs (best of {args.repeat} rounds of {args.iterations}; "
          f"{args.tokens}-token replies; Python {sys.version.split()[0]}, {PY})\n")
    print("| protocol | backend bytes | reads | " + " | ".join(PHASES) + " | total |")
    print("|---|--:|--:|" + "--:|" * (len(PHASES) + 1))
    for protocol, size, count, times in rows:
        cells = " | ".join(f"{times[p]:.1f}" for p in PHASES)
        print(f"| {protocol} | {size:,} | {count} | {cells} | {sum(times.values()):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

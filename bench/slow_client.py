"""Load generator for the many-slow-streams check: N concurrent streaming requests, each on its
own connection, opened at a steady rate; prints one JSON summary line.

Run by bench/run.py in its own process (pinned to the load CPU, with an open-file limit
raised for N sockets). Each stream is read to the end and checked like any other answer:
HTTP 200, the protocol's closing event, the expected number of text chunks.

    python bench/slow_client.py --url http://127.0.0.1:P --path /v1/chat/completions \
        --body-file body.json --protocol chat --tokens 20 --n 2000 [--rate 1000] [--header 'K: V']
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from collections import Counter
from urllib.parse import urlsplit

from workloads import check


def dechunk(body: bytes) -> bytes:
    """The payload of a chunked transfer-encoded body."""
    out, pos = [], 0
    while True:
        end = body.find(b"\r\n", pos)
        if end < 0:
            return b"".join(out)
        size = int(body[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2 : end + 2 + size])
        pos = end + 2 + size + 2


def parse(raw: bytes) -> tuple[int, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
    if any(ln.lower().startswith(b"transfer-encoding:") and b"chunked" in ln.lower() for ln in lines[1:]):
        body = dechunk(body)
    return status, body


class Opening:
    """Bounds the streams still being opened (connect, request, first bytes back), so the load
    generator never overflows the gateway's listen queue; counts the streams open at once."""

    def __init__(self, pending: int) -> None:
        self.slots = asyncio.Semaphore(pending)
        self.open = self.peak = 0
        self.last_open = 0.0  # when the last stream got its first bytes

    def started(self) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)
        self.last_open = time.monotonic()


async def one(host: str, port: int, request: bytes, timeout: float, protocol: str, tokens: int,
              gate: Opening) -> str | None:
    """One stream, read to EOF; None when complete, else why not."""
    async with gate.slots:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, TimeoutError) as exc:
            return f"connect: {type(exc).__name__}: {exc}"[:120]
        try:
            writer.write(request)
            first = await asyncio.wait_for(reader.read(65536), timeout)
        except (OSError, TimeoutError) as exc:
            writer.close()
            return f"first bytes: {type(exc).__name__}"
    gate.started()
    try:
        raw = first + await asyncio.wait_for(reader.read(-1), timeout)
    except (OSError, TimeoutError) as exc:
        return f"read: {type(exc).__name__}"
    finally:
        gate.open -= 1
        writer.close()
    status, body = parse(raw)
    return check(protocol, True, tokens, status, body)


async def run(a: argparse.Namespace) -> dict[str, object]:
    url = urlsplit(a.url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    body = open(a.body_file, "rb").read()
    extra = "".join(f"{h}\r\n" for h in a.header)
    request = (f"POST {a.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n").encode() + body
    gate = Opening(a.pending)
    start = time.monotonic()
    tasks = []
    for i in range(a.n):
        delay = start + i / a.rate - time.monotonic()  # at most `rate` per second
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(host, port, request, a.timeout, a.protocol, a.tokens, gate)))
    results = await asyncio.gather(*tasks)
    opened = gate.last_open - start
    problems = Counter(r for r in results if r is not None)
    return {"n": a.n, "completed": a.n - sum(problems.values()), "failed": sum(problems.values()),
            "problems": dict(problems.most_common(5)), "open_s": round(opened, 2), "peak_open": gate.peak,
            "total_s": round(time.monotonic() - start, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--body-file", required=True)
    p.add_argument("--protocol", required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--rate", type=float, default=1000.0, help="streams opened per second")
    p.add_argument("--pending", type=int, default=64, help="streams being opened at once, at most")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per stream")
    p.add_argument("--header", action="append", default=[], help="'Name: value' (repeatable)")
    a = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < a.n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(a.n + 256, soft), hard), hard))
    try:
        import uvloop

        summary = uvloop.run(run(a))
    except ImportError:
        summary = asyncio.run(run(a))
    print("SLOW " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""`kiln serve --workers N`: N gateway processes on one port, kept alive by a parent.

Each worker is a whole gateway (its own event loop, upstream pool, caches,
ledger writer) and binds the port itself with SO_REUSEPORT, so the kernel
spreads new connections evenly over the workers' own accept queues — a
shared listening socket tends to hand most connections to whichever worker
is awake, which a busy event loop is not. The parent holds no socket and
serves nothing: it starts the workers, restarts one that dies (with backoff
if it keeps dying), and on SIGTERM or SIGINT asks each to stop gracefully
(finish what is in flight, flush the ledger), killing what is still there
after the grace period. Workers share limits and money through Redis and
PostgreSQL (config.check_workers refuses to start without them); a worker
that dies loses only its connections: its leases expire and its streams are
billed from their last extension, its spool is adopted by its replacement.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

log = logging.getLogger("kiln.workers")

WORKER_ENV = "KILN_WORKER_INDEX"  # set in each worker: its index, 0..N-1
GRACE_S = 40.0  # uvicorn's own graceful shutdown is 30 s


def worker_index() -> int | None:
    """This process's index when it is one of several workers, else None."""
    value = os.environ.get(WORKER_ENV)
    return int(value) if value is not None else None


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other workers bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def supervise(count: int, host: str, port: int, argv: list[str]) -> int:
    """Run `count` workers of `kiln <argv>` on host:port until SIGTERM/SIGINT; returns the exit code."""
    if port == 0:  # every worker must bind the same port: choose it here
        with reuse_port_socket(host, 0) as probe:
            port = probe.getsockname()[1]
    args = [sys.executable, "-m", "kiln", *argv, "--port", str(port)]
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    workers: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
    failures = [0] * count

    def start(i: int) -> None:
        env = {**os.environ, WORKER_ENV: str(i)}
        proc = subprocess.Popen(args, env=env, process_group=0, preexec_fn=_die_with_parent)
        workers[i] = (proc, time.monotonic())

    print(f"kiln: {count} workers on http://{host}:{port} (SO_REUSEPORT)", flush=True)
    for i in range(count):
        start(i)
    restart_at: dict[int, float] = {}
    while not stopping:
        time.sleep(0.2)
        now = time.monotonic()
        for i, (proc, started) in list(workers.items()):
            if proc.poll() is None or i in restart_at:
                continue
            failures[i] = failures[i] + 1 if now - started < 10 else 1
            delay = min(0.5 * 2 ** (failures[i] - 1), 30.0)
            print(f"kiln: worker {i} (pid {proc.pid}) exited with {proc.returncode}; restarting in {delay:.1f}s",
                  file=sys.stderr, flush=True)
            restart_at[i] = now + delay
        for i, when in list(restart_at.items()):
            if now >= when and not stopping:
                del restart_at[i]
                start(i)
    for proc, _ in workers.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for proc, _ in workers.values():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


def _die_with_parent() -> None:
    """Linux: a worker gets SIGTERM when the parent dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

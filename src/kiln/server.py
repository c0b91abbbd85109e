"""How the gateway is served: uvicorn, with the connection limits it lacks, a raised
open-file limit, large buffers kept off the heap, a garbage collector that runs less often, and a
shutdown that bills every stream it cuts.

What uvicorn's httptools protocol honours and what it does not (uvicorn 0.3x-0.5x):
`backlog` and `timeout_keep_alive` yes, but the keep-alive timer runs only after a
response and stops at the first byte received, so a connection that never sends, or
sends a byte a second, is never timed out; `limit_concurrency` answers 503 per request
while the connections stay open (an idle flood then refuses every real request);
`h11_max_incomplete_event_size` applies to h11 only: httptools buffers request headers
of any size (quadratically). `guarded_protocol` adds, per connection and at no cost per
chunk of a response:

- request head (request line + headers) at most `max_header_bytes`, at most
  `max_headers` header lines: else 431 and close;
- the head must be complete `header_timeout_s` after the connection opened or its
  previous response ended: else 408 (or a plain close if nothing came) — slowloris;
- a head httptools cannot parse gets its 400 as JSON in the caller's protocol too;
- a lost connection calls back the disconnect guards of its requests (kiln.http), which
  cancel their work at once: no task per request watches `receive` for the disconnect;
- at most `max_connections` open (capped to what the open-file limit allows): a new
  connection beyond that closes the connection that has waited longest without a
  request in progress, so an idle flood cannot lock real clients out;
- a response's head goes out with the first piece of its body (`HeadWithBody`): one
  write, not two, for a JSON answer.

Slow bodies are bounded where the body is read (kiln.http.read_body, `body_timeout_s`).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import resource
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kiln.http import DISCONNECT, Disconnect

log = logging.getLogger("kiln.server")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_ALLOCATION = 32 * 1024  # bytes: from mmap, not the heap (keep_large_buffers_off_the_heap)
FD_RESERVE = 64  # descriptors kept for the database, the log, the upstream pool's spares
CUT_WAIT_S = 10.0  # after the grace: how long cut requests get to run their cleanup
SWEEP_EVERY_S = 0.5
GC_YOUNG_THRESHOLD = 10_000  # tracked allocations, net of frees, between two young collections (CPython: 700)


@dataclass
class ConnectionLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_connections: int = 10_000


@dataclass
class _Shared:
    """State all connections of one server share: who waits without a request, oldest first."""

    limits: ConnectionLimits
    waiting: OrderedDict[Any, float] = field(default_factory=OrderedDict)
    sweeper: asyncio.Task[None] | None = None

    async def sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close connections whose request head did not arrive in time."""
        timeout = self.limits.header_timeout_s
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            now = loop.time()
            while self.waiting:
                conn, since = next(iter(self.waiting.items()))
                if now - since < timeout:
                    break
                self.waiting.pop(conn)
                conn.timed_out()


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """An httptools protocol class enforcing `limits` (one shared state per server)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"shared": _Shared(limits)})


class GuardedProtocol(HttpToolsProtocol):
    """Per request it adds one flag test per read, and a dict pop and insert: no timer, no
    callback per header (the count is checked once the head is in, its size per read)."""

    # In slots: three more entries would grow every connection's instance dict to its next size.
    __slots__ = ("_head_done", "_head_bytes", "_refusal", "_lost")
    shared: _Shared

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = HeadWithBody(transport, self.loop)  # type: ignore[assignment]
        self._head_done = False  # the current request's head is in (its app runs)
        self._head_bytes = 0
        self._refusal: tuple[int, str] | None = None
        self._lost = Disconnect()  # its requests' guards register here (kiln.http.DisconnectGuard)
        self.url = b""
        shared = self.shared
        shared.waiting[self] = self.loop.time()
        if shared.sweeper is None:
            shared.sweeper = self.loop.create_task(shared.sweep(self.loop))
        if len(self.connections) > shared.limits.max_connections:
            self._evict()

    def _evict(self) -> None:
        """Over the cap: close the connection that has waited longest with no request in progress."""
        for conn in self.shared.waiting:
            if conn is not self:
                self.shared.waiting.pop(conn)
                conn.transport.close()
                return
        self.shared.waiting.pop(self, None)
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.shared.waiting.pop(self, None)
        super().connection_lost(exc)
        self._lost.fire()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[DISCONNECT] = self._lost  # type: ignore[literal-required]

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._head_done:
            self._head_bytes += len(data)
            if self._head_bytes > self.shared.limits.max_header_bytes:
                self._refuse(431, f"The request head is larger than {self.shared.limits.max_header_bytes} bytes.")

    def on_headers_complete(self) -> None:
        self._head_done = True
        self.shared.waiting.pop(self, None)
        if len(self.headers) > self.shared.limits.max_headers:
            # httptools turns a callback's exception into a parser error, which uvicorn answers
            # through send_400_response: that is where the refusal is sent.
            self._refusal = (431, f"The request has more than {self.shared.limits.max_headers} headers.")
            raise ValueError("too many headers")
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's head is already in: it starts now
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._head_done = False
            self._head_bytes = 0
            self.shared.waiting.pop(self, None)
            self.shared.waiting[self] = self.loop.time()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head httptools cannot parse: in the caller's protocol here."""
        self._refuse(*(self._refusal or (400, "Invalid HTTP request received.")))

    def timed_out(self) -> None:
        """The head did not arrive within header_timeout_s."""
        if self.transport.is_closing():
            return
        if self._head_bytes:
            self._refuse(408, "The request head did not arrive in time.")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer in the caller's protocol (Anthropic's under /v1/messages) and close."""
        self._head_done = True
        if self.transport.is_closing():
            return
        reason = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        body = _error_body(self.url, status, message)
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.transport.close()


class HeadWithBody:
    """A connection's transport that holds a response's head until the first piece of its
    body, or the end of this turn of the loop, whichever comes first.

    uvicorn writes the head when the app sends `http.response.start`, and the body when it
    sends the body: two syscalls (and two segments the client reads) where one does. A JSON
    answer's body follows in the same turn; a stream's first chunk often does. Every other
    use goes to the transport, a close only after the head is out.
    """

    __slots__ = ("transport", "loop", "head")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.loop = loop
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self.head
        if head is not None:
            self.head = None
            self.transport.write(head + data)
        elif data[:5] == b"HTTP/" and data[-4:] == b"\r\n\r\n":
            self.head = data
            self.loop.call_soon(self.flush)
        else:
            self.transport.write(data)

    def flush(self) -> None:
        head = self.head
        if head is not None:
            self.head = None
            self.transport.write(head)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def _error_body(url: bytes, status: int, message: str) -> bytes:
    if url.startswith(b"/v1/messages"):
        kind = "request_too_large" if status == 431 else "invalid_request_error"
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
    code = {400: "invalid_http_request", 408: "request_timeout", 431: "request_header_too_large"}[status]
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one where the OS allows; returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit from %d to %d", soft, target)
    return soft


def keep_large_buffers_off_the_heap(threshold: int = LARGE_ALLOCATION) -> bool:
    """Serve allocations of `threshold` bytes and more from mmap, given back to the OS when
    freed, not from glibc's heap; True if that is now in force.

    An agent's request (Claude Code, Codex: 60 KB and more) passes through several buffers
    of its size (the body, its encoding for the backend, the Responses head). On the heap,
    each leaves a hole when freed that the small long-lived objects of open streams pin,
    and glibc's own threshold rises to the largest block freed (up to 32 MiB), so it gets
    worse as conversations grow: measured, 208 KiB of RSS per open Claude Code-sized stream,
    137 KiB with this, and no CPU cost above the noise. glibc only (elsewhere a no-op); an
    operator's MALLOC_MMAP_THRESHOLD_ is left in force."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def collect_garbage_less_often(young: int = GC_YOUNG_THRESHOLD) -> None:
    """Freeze what startup built (the collector no longer walks it) and collect the young
    generation after `young` net allocations instead of CPython's 700.

    With the default, at c=64, the requests in flight hold more than 700 objects at any time, so
    the collector ran 190 times a second over them and, every second or so, a full collection
    walked the 58,000 objects startup left (31 ms each, a pause every request in flight waits out):
    11% of the gateway's time; chat JSON went from 2,096 to 2,608 rps with this. A request's
    objects die by reference counting, so the net count seldom reaches the threshold; cyclic
    garbage is still collected, and what waits for it is bounded by the threshold."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)


def connection_cap(configured: int, open_files: int) -> int:
    """At most `configured` connections, and no more than the file limit serves:
    a busy connection holds two descriptors (the client's and the backend's)."""
    return max(1, min(configured, (open_files - FD_RESERVE) // 2))


class GatewayServer(uvicorn.Server):
    """uvicorn's server with Kiln's shutdown.

    On SIGTERM (or a first Ctrl-C): stop accepting, let what runs finish within
    `grace_s`, then cut what is left (a second Ctrl-C cuts at once) and wait for the
    cut requests' cleanup, which meters each stream. The app's lifespan shutdown then
    always runs — uvicorn skips it after a second Ctrl-C — so the metering of cut
    streams finishes and the ledger is flushed before the process exits.
    """

    def __init__(self, config: uvicorn.Config, grace_s: float) -> None:
        super().__init__(config)
        self.grace_s = grace_s

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)  # the app's lifespan (store, catalog, pools) has run: freeze it
        collect_garbage_less_often()

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        log.info("shutting down: no new connections; %d requests running", len(self.server_state.tasks))
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while self.server_state.tasks and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.1)
        cut = list(self.server_state.tasks)
        if cut:
            log.warning("cutting %d requests still running (grace of %.0f s %s)", len(cut), self.grace_s,
                        "cut short by a second interrupt" if self.force_exit else "over")
            for task in cut:
                task.cancel(msg="gateway shutdown")
            await asyncio.wait(cut, timeout=CUT_WAIT_S)
        await self.lifespan.shutdown()


def serve(app: Any, settings: Any, sockets: list[Any] | None = None) -> None:
    """Run `app` under uvicorn with the server settings (see the [server] table); on `sockets`
    if given (a worker of several, on a port they share)."""
    open_files = raise_open_file_limit()
    if keep_large_buffers_off_the_heap():
        log.info("allocations of %d KiB and more are served from mmap, not the heap", LARGE_ALLOCATION // 1024)
    limits = ConnectionLimits(
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        header_timeout_s=settings.header_timeout_s,
        max_connections=connection_cap(settings.max_connections, open_files),
    )
    log.info("open-file limit %d; at most %d connections", open_files, limits.max_connections)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=guarded_protocol(limits),
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    server = GatewayServer(config, settings.shutdown_grace_s)
    server.run(sockets=sockets)
    if not server.started:
        raise SystemExit(3)

"""HTTP/1.1 from clients: one connection, and each of its requests handed to the ASGI app.

uvicorn's Server still runs the process (lifespan, signals, sockets, workers; kiln.server);
this protocol takes the place of its httptools protocol, which spent more per request than
the exchange needs: a copied state dict, an asyncio.Event and a 20-attribute cycle object,
two regular expressions per response header, a keep-alive timer per response, and the
proxy-headers middleware's pass over every header. Measured on a trivial app (wrk, c=64, one
core): 23 µs of CPU per request under uvicorn's protocol, 10 µs under a bare one. It parses
with httptools, as uvicorn does, and keeps to ASGI (HTTP spec 2.3), so Starlette's routes
run unchanged. What it adds per connection, at no cost per chunk of a response:

- request head (request line + headers) at most `max_header_bytes`, at most `max_headers`
  header lines: else 431 and close;
- the head must be complete `header_timeout_s` after the connection opened or its previous
  response ended: else 408 (or a plain close if nothing came) — slowloris, and the idle
  keep-alive limit, with one sweeper for all connections instead of a timer per response;
- a head httptools cannot parse gets its 400 as JSON in the caller's protocol too;
- a lost connection calls back the disconnect guards of its requests (kiln.http), which
  cancel their work at once: no task per request watches `receive` for the disconnect;
- at most `max_connections` open: a new connection beyond that closes the connection that
  has waited longest without a request in progress, so an idle flood cannot lock real
  clients out;
- a response's head goes out with the first piece of its body: one write, not two;
- X-Forwarded-Proto and X-Forwarded-For are read only from trusted peers
  (`FORWARDED_ALLOW_IPS`, default 127.0.0.1 and ::1, as uvicorn reads them).
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httptools
import orjson

from kiln.exchange import STATUS_LINES, App, Exchange
from kiln.forwarded import Trusted
from kiln.http import BODY, DISCONNECT, Disconnect

SWEEP_EVERY_S = 0.5
BODY_HIGH_WATER = 64 * 1024  # request body bytes buffered unread before the socket stops being read
ASGI = {"version": "3.0", "spec_version": "2.3"}


@dataclass
class ConnectionLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_connections: int = 10_000


@dataclass
class _Shared:
    """What all connections of one server share: the app, the limits, who waits without a
    request (oldest first) and the peers whose forwarding headers are believed."""

    app: App
    limits: ConnectionLimits
    trusted: Trusted
    root_path: str = ""
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


def protocol_for(app: App, limits: ConnectionLimits, root_path: str = "") -> type[ClientConnection]:
    """A protocol class for uvicorn's Server (`Config(http=...)`) serving `app` within `limits`."""
    shared = _Shared(app, limits, Trusted(os.environ.get("FORWARDED_ALLOW_IPS", "127.0.0.1,::1")), root_path)
    return type("KilnConnection", (ClientConnection,), {"shared": shared})


class ClientConnection(asyncio.Protocol):
    """One client connection: httptools calls the on_* methods as a request's head and body arrive."""

    shared: _Shared

    def __init__(self, config: Any = None, server_state: Any = None, app_state: dict[str, Any] | None = None,
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.server_state = server_state  # uvicorn's: connections, tasks, default headers
        self.app_state = app_state or {}
        self.loop = _loop or asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        try:  # bytes after a request that closes the connection are ignored, not a 400 mid-answer
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # httptools < 0.6.3
            pass
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.exchange: Exchange | None = None  # the request whose response is being sent
        # Requests that arrived behind it: rarely any, so a list (an empty deque is 600 bytes a
        # connection, which ten thousand open streams feel).
        self.pipeline: list[Exchange] = []
        self.read_paused = False
        self.writable: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self.lost = Disconnect()  # its requests' guards register here (kiln.http.DisconnectGuard)
        self.head_done = False  # the current request's head is in
        self.head_bytes = 0
        self.refusal: tuple[int, str] | None = None
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_continue = False
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.trusted = False

    # -- asyncio's side -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self.scheme = "https" if transport.get_extra_info("sslcontext") else "http"
        self.trusted = self.client is not None and self.client[0] in self.shared.trusted
        shared = self.shared
        shared.waiting[self] = self.loop.time()
        if shared.sweeper is None:
            shared.sweeper = self.loop.create_task(shared.sweep(self.loop))
        if len(self.server_state.connections) > shared.limits.max_connections:
            self._evict()

    def connection_lost(self, exc: Exception | None) -> None:
        # The parser holds this connection's callbacks: let it go, or every closed connection
        # waits in a cycle for the collector (tests/test_garbage.py). Nothing is fed after this.
        self.parser = None  # type: ignore[assignment]
        self.server_state.connections.discard(self)
        self.shared.waiting.pop(self, None)
        # The exchange in progress holds this connection, and so would this connection the
        # exchange, another cycle when a client leaves mid-answer; requests pipelined behind it
        # will not be served.
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.lose()
        self.pipeline.clear()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.lost.fire()

    def eof_received(self) -> None:
        pass  # a half-closed client may still read its answer

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self.exchange is not None:  # no upgrade is served: answer this request, then close
                self.exchange.keep_alive = False
        except httptools.HttpParserError:
            self._refuse(*(self.refusal or (400, "Invalid HTTP request received.")))
            return
        if not self.head_done:
            self.head_bytes += len(data)
            if self.head_bytes > self.shared.limits.max_header_bytes:
                self._refuse(431, f"The request head is larger than {self.shared.limits.max_header_bytes} bytes.")

    # -- httptools' side --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.expect_continue = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        value = value.rstrip(b" \t")  # llhttp keeps trailing whitespace, which is not the value's (RFC 9110 5.5)
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.shared.waiting.pop(self, None)
        if len(self.headers) > self.shared.limits.max_headers:
            # httptools turns a callback's exception into a parser error: data_received refuses.
            self.refusal = (431, f"The request has more than {self.shared.limits.max_headers} headers.")
            raise ValueError("too many headers")
        parser = self.parser
        url = httptools.parse_url(self.url)
        raw_path = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        root = self.shared.root_path
        version = parser.get_http_version()
        scope = {
            "type": "http", "asgi": ASGI, "http_version": version, "server": self.server, "client": self.client,
            "scheme": self.scheme, "method": parser.get_method().decode("ascii"), "root_path": root,
            "path": root + path if root else path, "raw_path": root.encode() + raw_path if root else raw_path,
            "query_string": url.query or b"", "headers": self.headers,
            "state": dict(self.app_state) if self.app_state else {}, DISCONNECT: self.lost,
        }
        if self.trusted:
            self.shared.trusted.apply(scope, self.headers)
        keep_alive = version != "1.0" and parser.should_keep_alive() and not parser.should_upgrade()
        exchange = Exchange(self, scope, keep_alive, self.expect_continue)
        scope[BODY] = exchange.arrived
        if self.exchange is None:
            self._start(exchange)
        else:  # pipelined behind a response in progress: read no further until it is served
            self.pipeline.append(exchange)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self.pipeline[-1] if self.pipeline else self.exchange
        if exchange is None or exchange.complete:
            return
        exchange.body.append(body)
        exchange.buffered += len(body)
        if exchange.buffered > BODY_HIGH_WATER:
            self._pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self.pipeline[-1] if self.pipeline else self.exchange
        if exchange is not None and not exchange.complete:
            exchange.more_body = False
            exchange.wake()

    # -- requests ----------------------------------------------------------------------

    def _start(self, exchange: Exchange) -> None:
        self.exchange = exchange
        task = self.loop.create_task(exchange.run(self.shared.app))
        tasks = self.server_state.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def finished(self, exchange: Exchange) -> None:
        """A response went out whole: the next pipelined request starts, or the wait for one."""
        self.server_state.total_requests += 1
        self.exchange = None
        if self.transport.is_closing():
            return
        self._resume_reading()
        if self.pipeline:
            self._start(self.pipeline.pop(0))
            return
        self.head_done = False
        self.head_bytes = 0
        waiting = self.shared.waiting
        waiting.pop(self, None)
        waiting[self] = self.loop.time()

    def _pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def shutdown(self) -> None:
        """The server stops: an idle connection closes now, a busy one after its response."""
        if self.exchange is None:
            self.transport.close()
        else:
            self.exchange.keep_alive = False
            self.pipeline.clear()

    # -- guards ------------------------------------------------------------------------------

    def _evict(self) -> None:
        """Over the cap: close the connection that has waited longest with no request in progress."""
        for conn in self.shared.waiting:
            if conn is not self:
                self.shared.waiting.pop(conn)
                conn.transport.close()
                return
        self.shared.waiting.pop(self, None)
        self.transport.close()

    def timed_out(self) -> None:
        """The head did not arrive within header_timeout_s."""
        if self.transport.is_closing():
            return
        if self.head_bytes:
            self._refuse(408, "The request head did not arrive in time.")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer in the caller's protocol (Anthropic's under /v1/messages) and close."""
        self.head_done = True
        if self.transport.is_closing():
            return
        body = _error_body(self.url, status, message)
        head = [STATUS_LINES[status], *[n + b": " + v + b"\r\n" for n, v in self.server_state.default_headers]]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


def _error_body(url: bytes, status: int, message: str) -> bytes:
    if url.startswith(b"/v1/messages"):
        kind = "request_too_large" if status == 431 else "invalid_request_error"
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})
    code = {400: "invalid_http_request", 408: "request_timeout", 431: "request_header_too_large"}[status]
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})

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
import http
import logging
import os
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import unquote

import httptools
import orjson

from kiln.forwarded import Trusted
from kiln.http import BODY, DISCONNECT, Disconnect

log = logging.getLogger("kiln.server")

SWEEP_EVERY_S = 0.5
BODY_HIGH_WATER = 64 * 1024  # request body bytes buffered unread before the socket stops being read
ASGI = {"version": "3.0", "spec_version": "2.3"}
STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in http.HTTPStatus}
_BAD_NAME = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')  # what no header name may hold
_BAD_VALUE = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")  # nor a value (a tab may)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_END = b"0\r\n\r\n"
App = Callable[..., Any]


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
        self.pipeline: deque[Exchange] = deque()  # requests that arrived behind it
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
        self.server_state.connections.discard(self)
        self.shared.waiting.pop(self, None)
        exchange = self.exchange
        if exchange is not None:
            exchange.lose()
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
            self._start(self.pipeline.popleft())
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


class Exchange:
    """One request and its response: the ASGI `receive` and `send` of the app's call."""

    __slots__ = ("conn", "scope", "keep_alive", "expect_continue", "body", "buffered", "more_body", "waiter",
                 "disconnected", "ended", "started", "complete", "chunked", "length", "head", "head_only")

    def __init__(self, conn: ClientConnection, scope: dict[str, Any], keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []
        self.buffered = 0
        self.more_body = True
        self.waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self.ended = False  # the app was given the end of the body
        self.started = self.complete = self.chunked = False
        self.length = 0  # body bytes still due (Content-Length)
        self.head: bytes | None = None  # the response head, held for the first piece of the body
        self.head_only = scope["method"] == "HEAD"

    async def run(self, app: App) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            self._close()
            raise
        except BaseException:
            log.exception("unhandled error in the app on %s %s", self.scope["method"], self.scope["path"])
            if not self.started and not self.disconnected:
                await self._error_500()
            else:
                self._close()
        else:
            if not self.complete and not self.disconnected:
                log.error("the app returned without completing its response to %s", self.scope["path"])
                if not self.started:
                    await self._error_500()
                else:
                    self._close()
        finally:
            # The scope holds this exchange's body reader (a bound method): a cycle, which
            # reference counting cannot free. Cut, the request's objects die when it ends,
            # not in a cycle collection (a pause that every request in flight waits out).
            del self.scope[BODY]

    async def receive(self) -> dict[str, Any]:
        """The body as it arrives; once all of it was given, waits for the response's end or
        the client's leaving and says `http.disconnect`."""
        if self.expect_continue:
            self.expect_continue = False
            if not self.conn.transport.is_closing():
                self.conn.transport.write(_CONTINUE)
        if not self.ended:
            while not self.body and self.more_body and not self.disconnected and not self.complete:
                self.conn._resume_reading()
                await self._wait()
            if self.body or not (self.disconnected or self.complete):
                self.ended = not self.more_body
                return {"type": "http.request", "body": self._take(), "more_body": self.more_body}
        while not self.disconnected and not self.complete:
            await self._wait()
        return {"type": "http.disconnect"}

    def arrived(self) -> bytes | None:
        """The whole body, taken, if it has all arrived and none of it was read; else None (then
        `receive` reads it). The common request comes in one read with its head: its body is
        ready when the app starts, and reading it needs no wait and no timer."""
        if self.ended or self.more_body or self.disconnected or self.expect_continue:
            return None
        self.ended = True
        return self._take()

    def _take(self) -> bytes:
        """The body that has arrived and not been read; reading goes on."""
        chunks, self.body, self.buffered = self.body, [], 0
        self.conn._resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _wait(self) -> None:
        self.waiter = self.conn.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if conn.writable is not None and not conn.writable.done() and not self.disconnected:
            await conn.writable  # the client reads slower than we write: wait for room
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {kind!r}")
            self.started = True
            self.expect_continue = False
            self._start(message["status"], message.get("headers", ()))
            return
        if self.complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r} after the response {self._state()}")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.head_only:
            body = b""
        elif self.chunked:
            body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + (b"" if more else _END)
        else:
            self.length -= len(body)
            if self.length < 0 or (not more and self.length):
                raise RuntimeError("the response body does not match its Content-Length")
        head = self.head
        if head is not None:
            self.head = None
            body = head + body
        if body:
            conn.transport.write(body)
        if not more:
            self.complete = True
            self.wake()
            if not self.keep_alive:
                conn.transport.close()
            conn.finished(self)

    def _state(self) -> str:
        return "was complete" if self.complete else "had started"

    def _start(self, status: int, headers: Any) -> None:
        """Build the head; it goes out with the first piece of the body, or at the end of this turn."""
        conn = self.conn
        lines = [STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        length: int | None = None
        chunked = False
        names: list[bytes] = []
        values: list[bytes] = []
        for name, value in (*conn.server_state.default_headers, *headers):
            names.append(name)
            values.append(value)
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = value.lower() == b"chunked"
            elif lower == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                continue
            lines.append(b"%b: %b\r\n" % (name, value))
        if _BAD_NAME.search(b"-".join(names)) or _BAD_VALUE.search(b"\t".join(values)):
            raise RuntimeError("a response header holds a character HTTP does not allow")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        if length is None and not chunked and not self.head_only and status not in (204, 304):
            chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        self.chunked = chunked
        self.length = length or 0
        self.head = b"".join(lines)
        conn.loop.call_soon(self._flush_head)

    def _flush_head(self) -> None:
        head = self.head
        if head is not None and not self.disconnected:
            self.head = None
            self.conn.transport.write(head)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def lose(self) -> None:
        """The connection was lost."""
        if not self.complete:
            self.disconnected = True
        self.wake()

    def _close(self) -> None:
        self._flush_head()
        self.conn.transport.close()

    async def _error_500(self) -> None:
        body = b"Internal Server Error"
        await self.send({"type": "http.response.start", "status": 500, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body)),
            (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": body})


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

"""HTTP/1.1 to model servers: the hot path's client, lean.

aiohttp's client spent about 120 µs of CPU on each call here (a URL object,
multidicts, a cookie jar, trace signals, a timer per read): more than a
quarter of what the gateway does per request. A model server needs one POST
with a few headers, on a kept-alive connection, and its answer read whole or
piece by piece as it arrives. This module is that, on asyncio's Protocol and
httptools (the parser uvicorn serves with), over plain TCP or TLS.

It raises ConnectFailed (no connection: nothing reached the server),
TimeoutError (a stream silent for longer than its idle limit) and BrokenAnswer
(an answer that breaks HTTP, or a connection closed mid-answer); upstream.py
turns those into the gateway's errors, once. Every other bound (the request's
deadline) is the caller's: cancelling a call closes its connection, which is
how a model server learns to stop generating.
"""

from __future__ import annotations

import asyncio
import copy
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

from kiln import timer_wheel
from kiln.running import running_loop

HIGH_WATER = 256 * 1024  # bytes of a stream held unread before the socket stops being read
# How long an answer whose content has ended may take to end its HTTP message. Servers send that
# end right after the last event; a connection that waits for it holds one of the pool's places.
SETTLE_S = 0.5


class ConnectFailed(Exception):
    """No connection could be made: refused, unresolvable, TLS refused, or too slow."""


class BrokenAnswer(Exception):
    """The server broke HTTP, or closed the connection before its answer was complete."""


class _Stale(BrokenAnswer):
    """A kept-alive connection the server had closed before our request reached it."""


class Pool:
    """The connections to one server: at most `limit` open, the rest of the callers wait in turn.

    Idle connections are reused newest first (the warmest), and dropped once
    the server closes them or they have idled for `keepalive_s`. A request on
    a reused connection that the server closes without a byte of answer (its
    keep-alive ran out as we sent) is sent again, once, on a new connection.
    """

    def __init__(self, base_url: str, limit: int, connect_s: float, keepalive_s: float = 60.0,
                 headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        self.limit = max(limit, 1)
        self.connect_s = connect_s
        self.keepalive_s = keepalive_s
        default_port = self.port == (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host = (host if default_port else f"{host}:{self.port}").encode()
        self._ssl = ssl.create_default_context() if self.tls else None
        self._fixed = b"".join(_header_line(n, v) for n, v in (headers or {}).items())  # every request's, encoded once
        self._idle: list[Connection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    async def request(self, method: str, path: str, headers: dict[str, str] | None, body: bytes,
                      idle_s: float | None = None) -> Response:
        """Send (`headers` beside the pool's own), and return once the answer's headers are in.
        `idle_s` bounds each wait for bytes."""
        head = self._head(method, path, headers, len(body))
        for reuse in (True, False):
            conn = await self._acquire(reuse)
            try:
                return await conn.exchange(head, body, idle_s)
            except _Stale:
                if not reuse:
                    raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._closed = True
        for conn in self._idle[:]:
            conn.close()

    def _head(self, method: str, path: str, headers: dict[str, str] | None, length: int) -> bytes:
        extra = b"".join(_header_line(n, v) for n, v in headers.items()) if headers else b""
        return (f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode() + b"Host: " + self._host
                + b"\r\nContent-Length: %d\r\n" % length + self._fixed + extra + b"\r\n")

    async def _acquire(self, reuse: bool) -> Connection:
        loop = running_loop()
        while True:
            while reuse and self._idle:
                conn = self._idle.pop()
                if conn.transport is not None and loop.time() - conn.idle_since < self.keepalive_s:
                    return conn
                conn.close()
            if self._open < self.limit:
                self._open += 1
                try:
                    return await self._connect(loop)
                except BaseException:
                    self._open -= 1
                    self._wake()
                    raise
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # our turn came as we were cancelled: pass it on
                else:
                    self._waiters.remove(waiter)
                raise
            reuse = True

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> Connection:
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(lambda: Connection(self), self.host, self.port,
                                                       ssl=self._ssl)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        return conn

    def _put(self, conn: Connection) -> None:
        """A connection whose answer was read to its end, kept alive for the next request."""
        if self._closed:
            conn.close()
            return
        conn.idle_since = conn.loop.time()
        self._idle.append(conn)
        self._wake()

    def _forget(self, conn: Connection) -> None:
        """A connection that is closed (by either side): its place goes to a waiter."""
        self._open -= 1
        if conn in self._idle:
            self._idle.remove(conn)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _header_line(name: str, value: str) -> bytes:
    if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
        raise ValueError(f"a line break in the {name!r} header")
    return f"{name}: {value}\r\n".encode()


class Connection(asyncio.Protocol):
    """One TCP connection and the answer in progress on it (httptools calls the on_* methods)."""

    __slots__ = ("pool", "transport", "parser", "idle_since", "uses", "status", "length", "chunked", "encoded",
                 "body", "buffered", "high_water", "paused", "headers_done", "complete", "keep_alive", "informational", "received", "error",
                 "waiter", "loop", "wait_since", "watchdog", "settling", "_counted")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser = None  # type: ignore[assignment]  # see connection_made
        self.loop = running_loop()
        self.idle_since = self.wait_since = 0.0
        self.watchdog: asyncio.Handle | timer_wheel.Entry | None = None  # idle_s: 10 minutes by default
        self.settling: asyncio.TimerHandle | None = None  # the end of an answer is awaited off the request's path
        self.uses = 0
        self._counted = True
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.length: int | None = None
        self.chunked = self.encoded = self.headers_done = self.complete = self.keep_alive = False
        self.received = self.paused = self.informational = False
        self.body: list[bytes] = []
        self.buffered = 0
        self.high_water = HIGH_WATER
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None

    async def exchange(self, head: bytes, body: bytes, idle_s: float | None) -> Response:
        if self.transport is None:
            raise _Stale("closed while idle") if self.uses else BrokenAnswer("closed before the request")
        self._reset()
        self.uses += 1
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        while not self.headers_done:
            await self.wait(idle_s)
        return Response(self, idle_s)

    async def wait(self, idle_s: float | None) -> None:
        """Until more of the answer (or its end, or an error) arrives; TimeoutError after `idle_s`.

        One watchdog timer per answer, not one per wait (a timer costs microseconds, and a
        slow stream waits once a token): it fires at the earliest moment a wait can have
        lasted `idle_s`, and rearms for the wait in progress."""
        if self.error is not None:
            # A copy: raised, the stored error would hold this frame, and the frame this
            # connection, in a cycle for the collector (tests/test_garbage.py).
            raise copy.copy(self.error)
        loop = self.loop
        self.waiter = waiter = loop.create_future()
        if idle_s is not None:
            self.wait_since = loop.time()
            if self.watchdog is None:
                self.watchdog = timer_wheel.call_at(loop, self.wait_since + idle_s, self._watch, idle_s)
        try:
            await waiter
        finally:
            self.waiter = None

    def _watch(self, idle_s: float) -> None:
        self.watchdog = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait arms it again
        due = self.wait_since + idle_s
        if self.loop.time() >= due:
            waiter.set_exception(TimeoutError())
        else:
            self.watchdog = timer_wheel.call_at(self.loop, due, self._watch, idle_s)

    def done_with(self, ended: bool = False) -> None:
        """The caller is done with the answer: keep the connection if the answer ended cleanly,
        or, when the caller knows its content `ended`, once its last bytes come (`_settle`)."""
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.complete and self.keep_alive and self.error is None and self.transport is not None:
            self.pool._put(self)
        elif ended and not self.complete and self.error is None and self.transport is not None:
            self._settle()
        else:
            self.close()

    def _settle(self) -> None:
        """Wait, off the request's path, for the end of an answer whose content has ended: a
        stream's last event comes before its HTTP message ends (the chunked encoding's last
        chunk), often in a read of its own. Its bytes are dropped; ended in `SETTLE_S`, the
        connection goes back to the pool, else it is closed."""
        self.body, self.buffered = [], 0
        self.resume()
        self.settling = self.loop.call_later(SETTLE_S, self.close)

    def _settled(self) -> None:
        assert self.settling is not None
        self.settling.cancel()
        self.settling = None
        self.done_with()  # ended cleanly: back to the pool; broken: closed

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.settling is not None:
            self.settling.cancel()
            self.settling = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self._counted:
            self._counted = False
            self.pool._forget(self)

    # -- asyncio's side ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Not in __init__: a connect that fails never calls connection_lost, which lets the
        # parser (and the cycle between it and this connection's callbacks) go.
        self.parser = httptools.HttpResponseParser(self)
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.complete:
            self._fail(BrokenAnswer("bytes after the answer's end"))
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(self.error or BrokenAnswer(f"not HTTP: {exc}"))
            return
        if self.settling is not None:
            if self.complete or self.error is not None:
                self._settled()
            return
        if self.buffered > self.high_water and not self.complete and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        # The parser holds this connection's callbacks: let it go, or every closed connection
        # waits in a cycle for the collector (tests/test_garbage.py). Nothing is fed after this.
        self.parser = None  # type: ignore[assignment]
        self.transport = None
        if self.settling is not None:
            self.settling.cancel()
            self.settling = None
        if self.headers_done and not self.complete and self.length is None and not self.chunked:
            self.complete = True  # an answer delimited by the connection's end
        elif not self.complete and self.error is None:
            if self.uses and not self.received:
                self.error = _Stale("closed before answering") if self.uses > 1 else \
                    BrokenAnswer("closed before answering")
            else:
                self.error = BrokenAnswer("closed mid-answer")
        self._wake()
        if self._counted:
            self._counted = False
            self.pool._forget(self)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    # -- httptools' side -------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise BrokenAnswer("a second answer to one request")

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self.length = int(value) if value.isdigit() else None
        elif name == b"transfer-encoding":
            self.chunked = value.lower().find(b"chunked") >= 0  # not `in`: see kiln.upstream.SSEParser.feed
        elif name == b"content-encoding":
            self.encoded = value.strip().lower() not in (b"", b"identity")

    def on_headers_complete(self) -> None:
        if self.encoded:
            self.error = BrokenAnswer("a compressed answer (no Accept-Encoding was sent)")
            raise copy.copy(self.error)
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue, 103 Early Hints: the answer is still to come
            self.informational = True
            return
        self.status = status
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self.settling is None:  # else dropped: the caller has had all it wanted
            self.body.append(body)
            self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            self.length, self.chunked = None, False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # the parser forgets it for the next message


class Response:
    """An answer whose headers are in; its body is read with `read` or `piece`, then `close`."""

    __slots__ = ("status", "content_length", "_conn", "_idle_s")

    def __init__(self, conn: Connection, idle_s: float | None) -> None:
        self.status = conn.status
        self.content_length = conn.length
        self._conn: Connection | None = conn
        self._idle_s = idle_s

    async def read(self, limit: int) -> bytes:
        """The whole body, or its first `limit + 1` bytes or more if it is longer; closes."""
        conn = self._conn
        assert conn is not None
        conn.high_water = limit + 1
        conn.resume()
        try:
            while not conn.complete and conn.buffered <= limit:
                await conn.wait(self._idle_s)
            return b"".join(conn.body)
        finally:
            self.close()

    async def piece(self) -> bytes:
        """What has arrived of the body since the last call, waiting for some; b"" at its end.

        What arrived before the connection broke is returned before the error is raised."""
        conn = self._conn
        assert conn is not None
        while not conn.body:
            if conn.complete:
                return b""
            await conn.wait(self._idle_s)
        pieces = conn.body
        conn.body = []
        conn.buffered = 0
        conn.resume()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self, ended: bool = False) -> None:
        """Done with it: an answer read to its end leaves its connection to the next request, and
        so does one whose content the caller knows has `ended` (a stream's last event), once the
        rest of its HTTP message comes; otherwise the connection is closed, which tells the
        server to stop generating."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done_with(ended)

"""One request on a client connection and its response: the ASGI `receive` and `send`.

The connection (kiln/connection.py) parses a request's head and hands its body here as it
arrives; the app reads it through `receive` and answers through `send`. The response head is
built once from the app's headers (checked for characters HTTP does not allow, and given
`transfer-encoding: chunked` when the app names no length) and goes out with the first piece
of the body, or at the end of the loop's turn: one write, not two.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import TYPE_CHECKING, Any, Callable

from kiln.http import BODY

if TYPE_CHECKING:
    from kiln.connection import ClientConnection

log = logging.getLogger("kiln.server")

App = Callable[..., Any]
STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in http.HTTPStatus}
# What a header name may hold (RFC 9110 `tchar`), and a value (anything but control characters;
# a tab may): deleted with bytes.translate, what is left is not allowed. A regular expression's
# character class cost about 50 instructions a byte, 10,000 a response.
_NAME_BYTES = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_VALUE_BYTES = bytes(b for b in range(256) if b == 0x09 or 0x20 <= b != 0x7F)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_END = b"0\r\n\r\n"


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
        if b"-".join(names).translate(None, _NAME_BYTES) or b"\t".join(values).translate(None, _VALUE_BYTES):
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

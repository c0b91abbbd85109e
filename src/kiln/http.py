"""HTTP plumbing the pipeline needs and Starlette does not give: a bounded
body reader, and a streaming response that sends keepalives on a timer and
cancels its producer when the client goes away.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.deadline import Deadline
from kiln.running import current_task, running_loop

Write = Callable[[bytes], Awaitable[None]]


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, or 413 before reading past `limit` bytes, or 408 if it takes
    longer than `timeout_s` to arrive (a slow-body attack holds no connection for long).

    Both refusals close the connection: the unread rest of the body would otherwise be
    read as the next request's head."""
    arrived = request.scope.get(BODY)
    body = arrived() if arrived is not None else None
    if body is not None:  # all there already (Kiln's server): no timer to arm, no header to read
        if len(body) > limit:
            raise _closing(errors.too_large(f"Request body is larger than {limit} bytes."))
        return body
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _closing(errors.too_large(f"Request body is larger than {limit} bytes."))
    receive = request.receive  # not request.stream(): an async generator per request costs more than the read
    chunks: list[bytes] = []
    size = 0
    try:
        with Deadline(timeout_s):
            while True:
                message = await receive()
                if message["type"] != "http.request":  # http.disconnect
                    raise errors.invalid("The client disconnected before the whole body arrived.")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _closing(errors.too_large(f"Request body is larger than {limit} bytes."))
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise _closing(GatewayError(408, f"The request body did not arrive within {timeout_s:g} s.",
                                    code="request_timeout")) from None
    return b"".join(chunks)  # one chunk: that chunk itself, no copy


def _closing(err: GatewayError) -> GatewayError:
    err.headers["Connection"] = "close"
    return err


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


DISCONNECT = "kiln.disconnect"  # scope key: the connection's Disconnect (set by Kiln's server)
BODY = "kiln.body"  # scope key: the whole body if it has all arrived, else None (set by Kiln's server)


class Disconnect:
    """What a connection runs when it is lost. Kiln's server (kiln.server) puts its
    connection's in each request's scope, so a guard registers a callback there and
    noticing a client that left costs no task; under another server a guard watches
    `receive` from a task instead."""

    __slots__ = ("lost", "callbacks")

    def __init__(self) -> None:
        self.lost = False
        self.callbacks: list[Callable[[], None]] = []

    def fire(self) -> None:
        self.lost = True
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback()


class DisconnectGuard:
    """Cancels the task that made it if the client disconnects inside its `with` block.

    The work then runs in the request's own task, so a request pays for no task of
    its own beside it and no `asyncio.wait` over both (a tenth of the gateway's CPU
    per request), and under Kiln's server not even for a watcher task (5% of the
    instructions of a JSON request): the connection calls back when it is lost. That
    callback (or the watcher) only runs while the task is suspended inside the block,
    so its cancel always lands there; the block then ends quietly with `fired` set,
    while a cancellation from anything else (a shutdown) goes on.
    """

    __slots__ = ("task", "fired", "_armed", "_watcher", "_hook")

    def __init__(self, receive: Receive, scope: Scope | None = None) -> None:
        self.task = current_task()
        self.fired = False
        self._armed = True
        self._watcher: asyncio.Future[None] | None = None
        self._hook: Disconnect | None = scope.get(DISCONNECT) if scope is not None else None
        if self._hook is None:
            self._watcher = asyncio.ensure_future(self._watch(receive))
        elif self._hook.lost:  # gone already: cancel once the block is waiting, as a watcher would
            running_loop().call_soon(self._fire)
        else:
            self._hook.callbacks.append(self._fire)

    def _fire(self) -> None:
        if self._armed and self.task is not None:
            self.fired = True
            self.task.cancel()

    async def _watch(self, receive: Receive) -> None:
        await wait_disconnect(receive)
        self._fire()

    def __enter__(self) -> DisconnectGuard:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        self._armed = False
        if self._watcher is not None:
            self._watcher.cancel()
        elif self._hook is not None and not self._hook.lost:
            self._hook.callbacks.remove(self._fire)
        if self.fired and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            if self.task is not None:
                self.task.uncancel()  # this guard's cancel: the task goes on, not cancelled
            return True
        return False


def _raw_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """Headers as ASGI sends them: lower-case names, latin-1 bytes."""
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers as a dict, the first of a repeated name winning (as with Starlette's
    `Headers.get`). Starlette's `Headers` looks a name up by scanning every header: the hot path's
    five lookups (two keys, two trace headers that are mostly absent, the affinity's session) cost
    five scans, against one pass here."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in reversed(scope["headers"])}


class JSONAnswer:
    """A 200 with a JSON body and a few headers: what Starlette's Response sends for it, without
    building its header list through MutableHeaders on the hot path's every answer."""

    __slots__ = ("body", "headers")

    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        self.body = body
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = [(b"content-length", b"%d" % len(self.body)), (b"content-type", b"application/json")]
        await send({"type": "http.response.start", "status": 200, "headers": raw + _raw_headers(self.headers)})
        await send({"type": "http.response.body", "body": self.body})


class StreamResponse:
    """An SSE response driven by a producer coroutine: it reaches the backend, writes frames
    through a `StreamOut` and returns the last ones, which go out with the end of the body
    (one write, not two), or returns a plain response (an error) if nothing was sent yet.

    The producer runs in the request's task, from before the backend answers: no second
    task waits for the backend while this one waits for it. A timer (no task) writes
    `keepalive()` whenever nothing was sent for `keepalive_s`; the first one, if the backend
    is that slow to answer, commits to the 200, so the client's connection stays open
    while it thinks. It is called each time because some protocols' keepalives are
    numbered events (Responses: `sequence_number`), not a fixed comment. If the client
    disconnects, the producer is cancelled; its own cleanup cancels the upstream request
    and meters what was generated.
    """

    __slots__ = ("produce", "headers", "keepalive", "keepalive_s")

    def __init__(
        self,
        produce: Callable[[StreamOut], Awaitable[bytes | Response]],
        headers: dict[str, str],
        keepalive: Callable[[], bytes],
        keepalive_s: float,
    ) -> None:
        self.produce = produce
        self.headers = headers
        self.keepalive = keepalive
        self.keepalive_s = keepalive_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                       (b"x-accel-buffering", b"no"), *_raw_headers(self.headers)]
        out = StreamOut(send, raw_headers, self.keepalive, self.keepalive_s)
        try:
            with DisconnectGuard(receive, scope) as guard:
                tail = await self.produce(out)
        except OSError:  # the client went away while we wrote (ASGI spec 2.4 servers)
            return
        finally:
            await out.close()
        if guard.fired:
            return
        if isinstance(tail, Response):  # refused before any byte was sent
            await tail(scope, receive, send)
            return
        try:
            await out.start()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except OSError:  # gone before the last frames: the request is metered already
            pass


class StreamOut:
    """Where a stream's producer writes: the 200 goes out before the first frame (or the
    first keepalive), and `committed()` tells, once the backend failed, whether it can still
    be answered with a plain error instead (and makes sure no keepalive starts one after).

    It is also the stream's keepalive: a timer, rearmed for what is left of the interval, calls
    `_tick`, and only the rare beat itself runs in a task. One object and no closures: an open
    stream holds less, and nothing in it forms a reference cycle, so a finished stream is freed
    at once by reference counting instead of waiting for (and costing) the garbage collector."""

    __slots__ = ("send", "headers", "started", "last", "keepalive", "every_s", "loop", "timer", "beating")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]], keepalive: Callable[[], bytes],
                 keepalive_s: float) -> None:
        self.send = send
        self.headers = headers
        self.started = False
        self.last = time.monotonic()
        self.keepalive = keepalive
        self.every_s = keepalive_s
        self.loop = running_loop()
        self.beating: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(keepalive_s, self._tick)

    async def start(self) -> None:
        """Send the 200 and its headers, once."""
        if not self.started:
            self.started = True  # before the await: a keepalive written meanwhile sends no second start
            self.last = time.monotonic()
            await self.send({"type": "http.response.start", "status": 200, "headers": self.headers})

    async def write(self, data: bytes) -> None:
        if not self.started:
            await self.start()
        self.last = time.monotonic()
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    def committed(self) -> bool:
        """True if the 200 is out; else no keepalive will send it (the timer stops) and the
        producer answers with a plain response."""
        if self.started:
            return True
        self.stop_keepalives()
        return False

    def _tick(self) -> None:
        idle = time.monotonic() - self.last
        if idle >= self.every_s:
            if self.beating is None or self.beating.done():  # a beat still being written is enough
                self.beating = asyncio.ensure_future(self._beat())
            idle = 0.0
        self.timer = self.loop.call_later(max(self.every_s - idle, 0.01), self._tick)

    async def _beat(self) -> None:
        # The task runs a turn of the loop after the tick: if the stream wrote meanwhile, no
        # keepalive lands between its chunks.
        if time.monotonic() - self.last >= self.every_s:
            await self.write(self.keepalive())

    def stop_keepalives(self) -> None:
        """No more beats, from now on (one scheduled but not yet running is dropped)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.beating is not None and not self.beating.done():
            self.beating.cancel()

    async def close(self) -> None:
        """No more beats, and the one being written (if any) is done."""
        self.stop_keepalives()
        if self.beating is not None:
            await asyncio.gather(self.beating, return_exceptions=True)
            self.beating = None

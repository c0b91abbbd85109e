"""HTTP plumbing the pipeline needs and Starlette does not give: a bounded
body reader, and a streaming response that sends keepalives on a timer and
cancels its producer when the client goes away.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from kiln.core import errors
from kiln.core.errors import GatewayError

Write = Callable[[bytes], Awaitable[None]]


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The request body, or 413 before reading past `limit` bytes, or 408 if it takes
    longer than `timeout_s` to arrive (a slow-body attack holds no connection for long).

    Both refusals close the connection: the unread rest of the body would otherwise be
    read as the next request's head."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _closing(errors.too_large(f"Request body is larger than {limit} bytes."))
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _closing(errors.too_large(f"Request body is larger than {limit} bytes."))
                chunks.append(chunk)
    except TimeoutError:
        raise _closing(GatewayError(408, f"The request body did not arrive within {timeout_s:g} s.",
                                    code="request_timeout")) from None
    except ClientDisconnect:
        raise errors.invalid("The client disconnected before the whole body arrived.") from None
    return b"".join(chunks)


def _closing(err: GatewayError) -> GatewayError:
    err.headers["Connection"] = "close"
    return err


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectGuard:
    """Cancels the task that made it if the client disconnects inside its `with` block.

    The work then runs in the request's own task, so a request pays for one
    watcher task, not a task for the work as well and an `asyncio.wait` over
    both (a tenth of the gateway's CPU per request). The watcher only runs
    while that task is suspended inside the block, so its cancel always lands
    there; the block then ends quietly with `fired` set, while a cancellation
    from anything else (a shutdown) goes on.
    """

    __slots__ = ("task", "fired", "_armed", "_watcher")

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.fired = False
        self._armed = True
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        await wait_disconnect(receive)
        if self._armed and self.task is not None:
            self.fired = True
            self.task.cancel()

    def __enter__(self) -> DisconnectGuard:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> bool:
        self._armed = False
        self._watcher.cancel()
        if self.fired and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            if self.task is not None:
                self.task.uncancel()  # this guard's cancel: the task goes on, not cancelled
            return True
        return False


class StreamResponse:
    """An SSE response driven by a producer coroutine that writes frames and returns the last
    ones, which go out with the end of the body (one write, not two).

    The producer runs in the request's task; a timer (no task) writes
    `keepalive()` whenever nothing was sent for `keepalive_s`, so idle
    connections stay open at no per-chunk cost. It is called each time because
    some protocols' keepalives are numbered events (Responses:
    `sequence_number`), not a fixed comment. If the client disconnects, the
    producer is cancelled; its own cleanup cancels the upstream request and
    meters what was generated.
    """

    def __init__(
        self,
        produce: Callable[[Write], Awaitable[bytes]],
        headers: dict[str, str],
        keepalive: Callable[[], bytes],
        keepalive_s: float,
        first: bytes = b"",
    ) -> None:
        self.produce = produce
        self.headers = headers
        self.keepalive = keepalive
        self.keepalive_s = keepalive_s
        self.first = first  # sent with the headers (a keepalive when the backend is already slow)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                       (b"x-accel-buffering", b"no")]
        raw_headers += [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        if self.first:
            await send({"type": "http.response.body", "body": self.first, "more_body": True})
        last = time.monotonic()

        async def write(data: bytes) -> None:
            nonlocal last
            last = time.monotonic()
            await send({"type": "http.response.body", "body": data, "more_body": True})

        keeper = _Keepalive(self.keepalive_s, lambda: last, lambda: write(self.keepalive()))
        try:
            with DisconnectGuard(receive) as guard:
                tail = await self.produce(write)
        except OSError:  # the client went away while we wrote (ASGI spec 2.4 servers)
            return
        finally:
            await keeper.stop()
        if guard.fired:
            return
        try:
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except OSError:  # gone before the last frames: the request is metered already
            pass


class _Keepalive:
    """Calls `beat()` (a write) whenever `last()` is `every_s` in the past: a timer, rearmed
    for what is left of the interval, and a task only for the rare beat itself."""

    def __init__(self, every_s: float, last: Callable[[], float], beat: Callable[[], Awaitable[None]]) -> None:
        self.every_s = every_s
        self.last = last
        self.beat = beat
        self.loop = asyncio.get_running_loop()
        self.beating: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(every_s, self._tick)

    def _tick(self) -> None:
        idle = time.monotonic() - self.last()
        if idle >= self.every_s:
            if self.beating is None or self.beating.done():  # a beat still being written is enough
                self.beating = asyncio.ensure_future(self._beat())
            idle = 0.0
        self.timer = self.loop.call_later(max(self.every_s - idle, 0.01), self._tick)

    async def _beat(self) -> None:
        # The task runs a turn of the loop after the tick: if the stream wrote meanwhile, no
        # keepalive lands between its chunks.
        if time.monotonic() - self.last() >= self.every_s:
            await self.beat()

    async def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.beating is not None:
            self.beating.cancel()
            await asyncio.gather(self.beating, return_exceptions=True)

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


class StreamResponse:
    """An SSE response driven by a producer coroutine that writes frames.

    A timer task writes `keepalive()` whenever nothing was sent for
    `keepalive_s`, so one task per stream keeps idle connections open with no
    per-chunk cost. It is called each time because some protocols' keepalives
    are numbered events (Responses: `sequence_number`), not a fixed comment.
    If the client disconnects, the producer is cancelled; its own cleanup
    cancels the upstream request and meters what was generated.
    """

    def __init__(
        self,
        produce: Callable[[Write], Awaitable[None]],
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

        async def keep_alive() -> None:
            while True:
                await asyncio.sleep(max(self.keepalive_s - (time.monotonic() - last), 0.01))
                if time.monotonic() - last >= self.keepalive_s:
                    await write(self.keepalive())

        producer = asyncio.ensure_future(self.produce(write))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        keeper = asyncio.ensure_future(keep_alive())
        try:
            await asyncio.wait((producer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            keeper.cancel()
            if not producer.done():
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
            disconnected = watcher.done()
            watcher.cancel()
        if producer.done() and not producer.cancelled():
            exc = producer.exception()
            if isinstance(exc, OSError):  # the client went away while we wrote (ASGI spec 2.4 servers)
                return
            if exc is not None:
                raise exc
        if not disconnected:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

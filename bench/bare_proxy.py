"""The bare pass-through proxy: the practical limit for a Python gateway on this stack.

Starlette with a pooled aiohttp client, served like Kiln (uvicorn with uvloop and httptools,
or Granian): it parses the JSON request body, adds one field, forwards it to the same path on
the upstream, and sends the upstream's answer back unparsed (streams as the SSE bytes arrive).
No authentication, metering, limits or translation: what is left is the cost of two HTTP hops.
Like Kiln, it answers its POSTs in plain ASGI past Starlette's router and middleware.

    python bench/bare_proxy.py --upstream http://127.0.0.1:PORT --port P [--server granian]
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

UPSTREAM_ENV = "BARE_PROXY_UPSTREAM"  # base URL of the model server, without /v1


class BareProxy:
    """POST /v1/... straight to the forwarding code (as Kiln's app skips Starlette's router on its
    hot path); anything else (GET /health) goes through Starlette."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
            self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                                 skip_auto_headers=("User-Agent",))
            try:
                yield
            finally:
                await self.session.close()

        async def health(_: Request) -> Response:
            return Response(b"ok")

        self.inner = Starlette(routes=[Route("/health", health)], lifespan=lifespan)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.inner(scope, receive, send)
            return
        body = orjson.loads(await Request(scope, receive).body())
        body["user"] = "bare-proxy"  # the one field a gateway adds
        assert self.session is not None
        async with self.session.post(self.upstream + scope["path"], data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as resp:
            media = resp.headers.get("Content-Type", "application/json").encode()
            await send({"type": "http.response.start", "status": resp.status,
                        "headers": [(b"content-type", media)]})
            if not body.get("stream"):
                await send({"type": "http.response.body", "body": await resp.read()})
                return
            async for piece in resp.content.iter_any():  # the SSE bytes as they arrive
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


def app() -> BareProxy:
    """The ASGI app (a factory, so Granian can build it in its worker)."""
    return BareProxy(os.environ[UPSTREAM_ENV])


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="model server base URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--server", choices=("uvicorn", "granian"), default="uvicorn")
    a = p.parse_args()
    os.environ[UPSTREAM_ENV] = a.upstream
    if a.server == "granian":
        from granian import Granian
        from granian.constants import HTTPModes, Interfaces, Loops

        here = os.path.dirname(os.path.abspath(__file__))
        Granian("bare_proxy:app", address=a.host, port=a.port, interface=Interfaces.ASGI, factory=True,
                workers=1, loop=Loops.uvloop, http=HTTPModes.http1, websockets=False, backlog=2048,
                log_enabled=False, working_dir=Path(here)).serve()
    else:
        import uvicorn

        uvicorn.run(app(), host=a.host, port=a.port, loop="uvloop", http="httptools", log_level="warning",
                    access_log=False, backlog=2048)


if __name__ == "__main__":
    main()

"""How the gateway is served: uvicorn's Server (lifespan, signals, sockets) with Kiln's own
HTTP/1.1 protocol (kiln.connection: the connection limits, leaner per request), a raised
open-file limit, a garbage collector that runs less often,
and a shutdown that bills every stream it cuts.

Slow bodies are bounded where the body is read (kiln.http.read_body, `body_timeout_s`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import resource
from typing import Any

import uvicorn

from kiln.connection import ConnectionLimits, protocol_for

log = logging.getLogger("kiln.server")

FD_RESERVE = 64  # descriptors kept for the database, the log, the upstream pool's spares
CUT_WAIT_S = 10.0  # after the grace: how long cut requests get to run their cleanup
GC_YOUNG_THRESHOLD = 10_000  # tracked allocations, net of frees, between two young collections (CPython: 700)


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
        http=protocol_for(app, limits),
        proxy_headers=False,  # kiln.connection reads them, from trusted peers only
        server_header=False,
        headers=[("server", "kiln")],
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )
    server = GatewayServer(config, settings.shutdown_grace_s)
    server.run(sockets=sockets)
    if not server.started:
        raise SystemExit(3)

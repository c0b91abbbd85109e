"""Backend choice and health.

Round-robin over the model's backends that are not known to be down. A
backend that refuses a connection is marked down for a while and the next
one is tried (nothing reached the model, so this is safe); a background
probe brings it back as soon as its /health answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from kiln.catalog import Backend, Catalog, Model
from kiln.core import errors
from kiln.upstream import Upstream

log = logging.getLogger("kiln.router")


class Router:
    def __init__(self, catalog: Catalog, upstream: Upstream, retry_s: float = 5.0) -> None:
        self.catalog = catalog
        self.upstream = upstream
        self.retry_s = retry_s
        self._turn = itertools.count()
        self._task: asyncio.Task[None] | None = None

    def candidates(self, model: Model) -> list[Backend]:
        """Backends to try, in order; 503 when every one is known to be down."""
        up = [b for b in model.backends if b.available]
        if not up:
            raise errors.unavailable(f"No backend for model '{model.id}' is available right now. Retry later.")
        if len(up) > 1:
            start = next(self._turn) % len(up)
            up = up[start:] + up[:start]
        return up

    def failed(self, backend: Backend) -> None:
        if backend.available:
            log.warning("backend %s is unreachable; marking it down", backend.url)
        backend.mark_down(self.retry_s)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(b) for b in self.catalog.backends()))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kiln-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s)
            await self.probe_all()

    async def _probe(self, backend: Backend) -> None:
        timeout = min(self.retry_s, 5.0)
        root = backend.url.removesuffix("/v1")
        ok = await self.upstream.ping(root + "/health", timeout) or await self.upstream.ping(
            backend.url + "/models", timeout
        )
        if not ok:
            if backend.available:
                log.warning("backend %s failed its health check; marking it down", backend.url)
            backend.mark_down(self.retry_s * 3)  # down until a probe passes (probes run every retry_s)
            return
        if not backend.available:
            log.info("backend %s is back", backend.url)
        backend.mark_up()

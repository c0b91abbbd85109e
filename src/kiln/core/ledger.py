"""The usage ledger: durable usage events, written by group commit.

A request hands its event to `record()` and waits for the commit that
includes it, so the event is durable before the response's last byte. One
writer task drains everything queued while the previous commit ran into the
next transaction: under load many requests share one commit, and an idle
gateway commits a lone event at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable
from kiln.core.records import UsageEvent
from kiln.store.base import Store

log = logging.getLogger("kiln.ledger")

MAX_BATCH = 1000


def new_generation_id() -> str:
    """96 random bits: unique, not a secret (no syscall per request)."""
    return f"gen-{random.getrandbits(96):024x}"


class Ledger:
    def __init__(self, store: Store, on_commit: Callable[[float, int], None] | None = None) -> None:
        self.store = store
        self.on_commit = on_commit  # (seconds the commit took, events in it): for metrics
        self._queue: asyncio.Queue[tuple[UsageEvent, asyncio.Future[None]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kiln-ledger")

    async def stop(self) -> None:
        """Flush what is queued, then stop the writer."""
        if self._task is None:
            return
        await self._queue.join()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    @property
    def depth(self) -> int:
        """Events queued and not yet committed (for the metrics)."""
        return self._queue.qsize()

    def submit(self, event: UsageEvent) -> asyncio.Future[None]:
        """Queue an event; the future resolves once it is committed."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((event, fut))
        return fut

    async def record(self, event: UsageEvent) -> None:
        """Queue an event and wait until it is durable.

        Shielded: a client that goes away mid-wait does not cancel the commit.
        """
        await asyncio.shield(self.submit(event))

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < MAX_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            events = [e for e, _ in batch]
            delay = 0.05
            while True:
                try:
                    began = time.monotonic()
                    await self.store.record_usage(events)
                    if self.on_commit is not None:
                        self.on_commit(time.monotonic() - began, len(events))
                    break
                except asyncio.CancelledError:
                    raise
                except Exception:  # keep every event: retry until the store takes it
                    log.exception("usage commit failed for %d events; retrying in %.2fs", len(events), delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)
                self._queue.task_done()

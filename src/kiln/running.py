"""The running event loop and task, without a system call each time.

On Python 3.11, `asyncio.get_running_loop()` (and `current_task()` without a loop, which calls
it) checks the process id on every call, to catch a loop inherited through fork(): a getpid()
system call, about a dozen per request on the hot path, 5% of the gateway's CPU under a
streaming load (py-spy --native). Kiln never forks with a running loop (workers are new
processes), so the loop is remembered per thread and asked for again only once it has stopped.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class _Remembered(threading.local):
    loop: asyncio.AbstractEventLoop | None = None


_remembered = _Remembered()


def running_loop() -> asyncio.AbstractEventLoop:
    """What asyncio.get_running_loop() returns (and the same RuntimeError outside a loop)."""
    loop = _remembered.loop
    if loop is None or not loop.is_running():
        loop = _remembered.loop = asyncio.get_running_loop()
    return loop


def current_task() -> asyncio.Task[Any] | None:
    """What asyncio.current_task() returns."""
    return asyncio.current_task(running_loop())

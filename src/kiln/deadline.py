"""A time limit for a block of awaits: what `asyncio.timeout` does, at the hot path's price.

`asyncio.timeout` is an async context manager (two coroutines each use) with a state
machine for rescheduling and nesting; a JSON request went through three (its body, the
backend's headers, the whole call), 6.5% of the gateway's CPU. `Deadline` is a plain
context manager around one timer: when it fires while the block waits, the task is
cancelled and the block ends in TimeoutError; a cancellation from anything else (a
disconnect guard, a shutdown) goes on as CancelledError, as with `asyncio.timeout`.
"""

from __future__ import annotations

import asyncio

from kiln import timer_wheel
from kiln.running import running_loop


class Deadline:
    """`with Deadline(seconds):` — None: no limit, but `expire()` can still end the block."""

    __slots__ = ("expired", "_loop", "_task", "_handle", "_active", "_cancelling")

    def __init__(self, seconds: float | None) -> None:
        self.expired = False
        self._loop = running_loop()
        self._task = asyncio.current_task(self._loop)
        self._active = False
        self._cancelling = 0
        self._handle: asyncio.Handle | timer_wheel.Entry | None = None
        if seconds is not None:  # a long limit (a request's hour) is a coarse timer: see timer_wheel
            self._handle = timer_wheel.call_later(self._loop, max(seconds, 0.0), self._expire)

    def expire(self) -> None:
        """End the block now, as if its time were up (it gets TimeoutError once it waits)."""
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_soon(self._expire)

    def _expire(self) -> None:
        if self._active and not self.expired and self._task is not None:
            self.expired = True
            self._task.cancel()

    def __enter__(self) -> Deadline:
        self._active = True
        if self._task is not None:
            self._cancelling = self._task.cancelling()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, _: object) -> None:
        self._active = False
        if self._handle is not None:
            self._handle.cancel()
        if self.expired and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            if self._task is not None and self._task.uncancel() <= self._cancelling:
                raise TimeoutError from exc

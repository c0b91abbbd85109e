"""Coarse timers for the long limits every request arms and almost none reaches.

A request's time limit (an hour by default) and a stream's idle limit (ten minutes) are set
for every request and cancelled when it ends. As loop timers, each holds a timer handle and
a libuv timer while the request lives (about 600 bytes: 12 MB for ten thousand open streams,
which hold both) and costs a heap insertion and removal. Here each is an entry in the bucket
of its second, and one loop timer, ticking once a second while any entry is left, runs what
is due: at most `TICK_S` late, never early. Shorter delays keep an exact loop timer
(`call_at`), so a short limit set in a test or a configuration is as precise as before.
An entry set and cancelled costs more instructions than a uvloop timer (Python, not C: about
5K more per request) but less time (1.1 against 1.5 us in process; 1.1 against 2.3 us with
100,000 held, where a loop timer's heap grows).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Callable

TICK_S = 1.0
# Delays from this long on go to the wheel: the request's limit (3600 s) and the stream's idle
# limit (600 s), held as long as a request lives; not the body's (60 s) or a backend's headers'
# (120 s), held for milliseconds, whose precision is worth more than the memory.
COARSE_FROM_S = 300.0


class Entry:
    """A scheduled call; `cancel()` as on an asyncio handle (idempotent)."""

    __slots__ = ("callback", "args", "bucket", "wheel")

    def __init__(self, callback: Callable[..., Any], args: tuple[Any, ...], bucket: int, wheel: Wheel) -> None:
        self.callback = callback
        self.args = args
        self.bucket = bucket
        self.wheel: Wheel | None = wheel

    def cancel(self) -> None:
        # The callback goes too: it is usually a bound method of the object that holds this
        # entry, and a cycle left behind would wait for the garbage collector.
        self.callback, self.args = _nothing, ()
        wheel = self.wheel
        if wheel is not None:
            self.wheel = None
            entries = wheel.buckets.get(self.bucket)
            if entries is not None:
                entries.discard(self)
                if not entries:
                    del wheel.buckets[self.bucket]


def _nothing() -> None:
    pass


class Wheel:
    """The coarse timers of one event loop."""

    __slots__ = ("loop", "tick_s", "buckets", "handle", "next_bucket")

    def __init__(self, loop: asyncio.AbstractEventLoop, tick_s: float = TICK_S) -> None:
        self.loop = loop
        self.tick_s = tick_s
        self.buckets: dict[int, set[Entry]] = {}
        self.handle: asyncio.TimerHandle | None = None
        self.next_bucket = 0  # the first bucket not yet run

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Entry:
        """Run `callback(*args)` at the first tick at or after `when` (the loop's clock)."""
        bucket = max(int(when / self.tick_s) + 1, self.next_bucket)  # the next after `when`: never early
        entry = Entry(callback, args, bucket, self)
        entries = self.buckets.get(bucket)
        if entries is None:
            self.buckets[bucket] = {entry}
        else:
            entries.add(entry)
        if self.handle is None:
            self.next_bucket = max(self.next_bucket, math.floor(self.loop.time() / self.tick_s) + 1)
            self.handle = self.loop.call_at(self.next_bucket * self.tick_s, self._tick)
        return entry

    def _tick(self) -> None:
        now = math.floor(self.loop.time() / self.tick_s)
        buckets = self.buckets
        for bucket in range(self.next_bucket, now + 1):
            for entry in buckets.pop(bucket, ()):
                if entry.wheel is not None:
                    self.loop.call_soon(entry.callback, *entry.args)
                    entry.wheel, entry.callback, entry.args = None, _nothing, ()
        self.next_bucket = now + 1
        self.handle = self.loop.call_at(self.next_bucket * self.tick_s, self._tick) if buckets else None


_current: Wheel | None = None  # the running loop's: a gateway has one loop; another loop gets a new wheel


def call_at(loop: asyncio.AbstractEventLoop, when: float, callback: Callable[..., Any],
            *args: Any) -> asyncio.Handle | Entry:
    """`loop.call_at`, but on the loop's wheel when `when` is `COARSE_FROM_S` or more away."""
    if when - loop.time() < COARSE_FROM_S:
        return loop.call_at(when, callback, *args)
    return _wheel(loop).call_at(when, callback, *args)


def call_later(loop: asyncio.AbstractEventLoop, delay: float, callback: Callable[..., Any],
               *args: Any) -> asyncio.Handle | Entry:
    """`loop.call_later`, but on the loop's wheel when `delay` is `COARSE_FROM_S` or more."""
    if delay < COARSE_FROM_S:
        return loop.call_later(delay, callback, *args)
    return _wheel(loop).call_at(loop.time() + delay, callback, *args)


def _wheel(loop: asyncio.AbstractEventLoop) -> Wheel:
    """The wheel of `loop`. A wheel left by another loop keeps its own entries and timer."""
    global _current
    wheel = _current
    if wheel is None or wheel.loop is not loop:
        wheel = _current = Wheel(loop)
    return wheel

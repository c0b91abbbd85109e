"""The gateway's clock: wall time and monotonic time with a shared offset.

Everything that counts time for limits and budgets (rate windows, calendar
months, key spend periods, key expiry) reads this clock, so tests can move
it forward through the admin API when the gateway runs with
KILN_TEST_CLOCK=1, instead of sleeping for a minute or a month.
"""

from __future__ import annotations

import time


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self.offset += seconds


CLOCK = Clock()

"""The in-process rate windows (kiln/core/admission.py), driven through MemoryAdmission's calls
with the gateway's clock, moved forward the way KILN_TEST_CLOCK moves it: what they hold does not grow with the request rate, and a limit
is never passed however the requests fall within their tenth of a second."""

from __future__ import annotations

import asyncio
import math
import tracemalloc
from decimal import Decimal

import pytest

from kiln.config import Limits
from kiln.core.admission import Demand, MemoryAdmission
from kiln.core.clock import Clock
from kiln.core.errors import GatewayError
from kiln.core.records import ApiKey, Org

DEMAND = Demand(prompt_tokens_max=100, input_nano_per_token=Decimal(150), output_nano_per_token=Decimal(600),
                max_output_tokens=20, stream=False)


def move_to(clock: Clock, at: float) -> None:
    """Move the gateway's clock (forward only) so its monotonic time reads `at`, give or take the
    microseconds real time adds before the next call."""
    clock.advance(max(at - clock.monotonic(), 0.0))


def parties(rpm: int | None = None) -> tuple[ApiKey, Org]:
    org = Org(id="org_1", name="o", credits_nano=10**18)
    return ApiKey(id="key_1", project_id="p", org_id="org_1", key_hash="h", prefix="sk", rpm_limit=rpm), org


def test_windows_hold_no_entry_per_request() -> None:
    """A minute at 1,000 requests a second: an entry per request would hold 60,000 of them in
    each of four windows (the organisation's and the key's requests and tokens: over 15 MB);
    the requests of one tenth of a second share an entry."""
    clock = Clock()
    admission = MemoryAdmission(Limits(rpm=10**9, concurrency=10**9), clock)
    key, org = parties()

    async def minute() -> None:
        for _ in range(6_000):
            for _ in range(10):  # 10 requests in each 10 ms
                ticket = await admission.admit(key, org, DEMAND)
                await admission.settle(ticket, key, org, cost_nano=1, tokens=40)
            clock.advance(0.01)

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        asyncio.run(minute())
        held = tracemalloc.get_traced_memory()[0] - before
        asyncio.run(minute())  # the key has no limits of its own: nothing reads its windows
        held_later = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, f"{held} bytes held after a minute of 60,000 requests"
    assert held_later < held + 100_000, f"{held_later - held} bytes more after a second minute"


@pytest.mark.parametrize("offset", [0.0, 0.01, 0.05, 0.099])
def test_a_window_never_opens_early(offset: float) -> None:
    """Requests stamped anywhere in their tenth of a second stay counted for a whole minute."""
    clock = Clock()
    move_to(clock, math.floor(clock.monotonic()) + 1 + offset)  # `offset` into a tenth of a second
    admission = MemoryAdmission(Limits(rpm=10**9, concurrency=10**9), clock)
    key, org = parties(rpm=2)

    async def run() -> None:
        first = clock.monotonic()
        for _ in range(2):
            await admission.settle(await admission.admit(key, org, DEMAND), key, org)
        for at in (first + 1, first + 59.0, first + 59.99):
            move_to(clock, at)
            with pytest.raises(GatewayError) as refused:
                await admission.admit(key, org, DEMAND)
            assert refused.value.status == 429
            assert 1 <= int(refused.value.headers["retry-after"]) <= 60
        move_to(clock, first + 60.1)  # at most a tenth of a second later than an exact window
        await admission.settle(await admission.admit(key, org, DEMAND), key, org)

    asyncio.run(run())

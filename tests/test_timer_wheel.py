"""kiln.timer_wheel: the coarse timers of the long limits (a request's hour, a stream's idle
minutes). Run here with a short tick, on a real event loop: never early, at most a tick late,
cancelled entries never run, and an idle wheel leaves no timer on the loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from kiln import timer_wheel
from kiln.deadline import Deadline
from kiln.timer_wheel import Entry, Wheel

TICK = 0.05
SLACK = 0.03  # the loop's own lateness on a busy machine


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_entries_run_at_or_after_their_time_and_at_most_a_tick_late() -> None:
    async def main() -> list[tuple[str, float, float]]:
        loop = asyncio.get_running_loop()
        wheel = Wheel(loop, TICK)
        ran: list[tuple[str, float, float]] = []
        start = loop.time()
        for name, delay in (("c", 0.31), ("a", 0.02), ("b", 0.13), ("a2", 0.02)):
            wheel.call_at(start + delay, lambda n, w: ran.append((n, w, loop.time())), name, start + delay)
        await asyncio.sleep(0.5)
        assert not wheel.buckets and wheel.handle is None  # idle: no timer left on the loop
        return ran

    ran = run(main())
    assert sorted(n for n, _, _ in ran) == ["a", "a2", "b", "c"]
    assert [n for n, _, _ in ran][-2:] == ["b", "c"]
    for name, when, at in ran:
        assert at >= when, f"{name} ran {when - at:.3f} s early"
        assert at <= when + TICK + SLACK, f"{name} ran {at - when:.3f} s late"


def test_a_cancelled_entry_never_runs_and_leaves_no_bucket() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        wheel = Wheel(loop, TICK)
        ran: list[str] = []
        keep = wheel.call_at(loop.time() + 0.1, ran.append, "kept")
        gone = wheel.call_at(loop.time() + 0.1, ran.append, "cancelled")
        alone = wheel.call_at(loop.time() + 0.3, ran.append, "alone")
        gone.cancel()
        gone.cancel()  # twice is harmless
        alone.cancel()
        assert len(wheel.buckets) == 1  # the emptied bucket went with its last entry
        await asyncio.sleep(0.25)
        keep.cancel()  # after it ran: harmless
        assert not wheel.buckets and wheel.handle is None
        return ran

    assert run(main()) == ["kept"]


def test_buckets_passed_while_the_loop_was_blocked_all_run() -> None:
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        wheel = Wheel(loop, TICK)
        ran: list[int] = []
        for i in range(5):
            wheel.call_at(loop.time() + 0.02 + i * TICK, ran.append, i)
        time.sleep(0.4)  # the loop is stuck past every bucket
        await asyncio.sleep(TICK + SLACK)
        return ran

    assert run(main()) == [0, 1, 2, 3, 4]


def test_long_delays_go_to_the_wheel_and_short_ones_stay_exact() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        short = timer_wheel.call_at(loop, loop.time() + 1.0, lambda: None)
        long = timer_wheel.call_at(loop, loop.time() + timer_wheel.COARSE_FROM_S + 1, lambda: None)
        assert isinstance(short, asyncio.TimerHandle) and isinstance(long, Entry)
        short.cancel()
        long.cancel()

    run(main())


def test_a_deadline_of_an_hour_is_a_coarse_timer_and_still_ends_its_block_when_told() -> None:
    async def main() -> None:
        with Deadline(3600.0) as d:
            assert isinstance(d._handle, Entry)
            asyncio.get_running_loop().call_later(0.02, d.expire)  # e.g. the key was revoked
            await asyncio.sleep(1)

    with pytest.raises(TimeoutError):
        run(main())

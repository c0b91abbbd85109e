"""kiln.deadline.Deadline: asyncio.timeout's behaviour on the hot path (the gateway's request,
body and backend-header limits use it; their 408 and 504 answers are tested end to end)."""

from __future__ import annotations

import asyncio

import pytest

from kiln.deadline import Deadline


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 5))


def test_a_block_past_its_time_ends_in_timeout_error_and_the_task_goes_on() -> None:
    async def main() -> str:
        with pytest.raises(TimeoutError):
            with Deadline(0.02) as d:
                await asyncio.sleep(1)
        assert d.expired
        await asyncio.sleep(0)  # not cancelled any more
        return "went on"

    assert run(main()) == "went on"


def test_a_block_within_its_time_is_left_alone_and_its_timer_cancelled() -> None:
    async def main() -> str:
        with Deadline(0.05) as d:
            await asyncio.sleep(0)
        await asyncio.sleep(0.1)  # past the time: nothing fires after the block
        assert not d.expired
        return "fine"

    assert run(main()) == "fine"


def test_none_never_expires_unless_told() -> None:
    async def main() -> None:
        with Deadline(None) as d:
            asyncio.get_running_loop().call_later(0.02, d.expire)  # e.g. the backend went down
            await asyncio.sleep(1)

    with pytest.raises(TimeoutError):
        run(main())


def test_another_cancellation_stays_a_cancellation() -> None:
    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.02, task.cancel)  # a shutdown, a disconnect guard
        with Deadline(1.0):
            await asyncio.sleep(1)

    async def outer() -> str:
        try:
            await asyncio.create_task(main())
        except asyncio.CancelledError:
            return "cancelled"
        return "not cancelled"

    assert run(outer()) == "cancelled"


def test_expired_together_with_another_cancellation_stays_a_cancellation() -> None:
    async def main() -> None:
        task = asyncio.current_task()
        assert task is not None
        with Deadline(0.02) as d:
            asyncio.get_running_loop().call_later(0.02, task.cancel)
            await asyncio.sleep(1)
        assert d.expired

    async def outer() -> str:
        try:
            await asyncio.create_task(main())
        except asyncio.CancelledError:
            return "cancelled"
        except TimeoutError:
            return "timeout"
        return "neither"

    assert run(outer()) == "cancelled"

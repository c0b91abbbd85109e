"""The disconnect guard: under Kiln's server the connection calls it back when it is lost (no
watcher task); under another server it watches `receive`. Either way only the work inside the
block is cancelled, and the request's task goes on to record what happened. The end-to-end
cancellations (a usage event, the backend request cancelled) are in test_chat_stream.py."""

from __future__ import annotations

import asyncio
from typing import Any

from kiln.http import DISCONNECT, Disconnect, DisconnectGuard


async def _never() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {}


def guarded(scope: dict[str, Any], receive: Any = _never) -> tuple[bool, str]:
    """Run a block that waits a second; (guard.fired, what the task did after the block)."""
    async def request() -> tuple[bool, str]:
        with DisconnectGuard(receive, scope) as guard:
            await asyncio.sleep(1)
            return False, "the block ran to its end"
        return guard.fired, "the task went on"

    return asyncio.run(asyncio.wait_for(request(), 5))


def test_a_lost_connection_cancels_the_block_through_its_callback() -> None:
    lost = Disconnect()

    scope = {DISCONNECT: lost}

    async def request() -> tuple[bool, str, int]:
        asyncio.get_running_loop().call_later(0.05, lost.fire)
        with DisconnectGuard(_never, scope) as guard:
            await asyncio.sleep(1)
        return guard.fired, "the task went on", len(asyncio.all_tasks())

    fired, after, tasks = asyncio.run(asyncio.wait_for(request(), 5))
    assert (fired, after) == (True, "the task went on")
    assert tasks == 2, "no watcher task beside the request (only it and wait_for's)"
    assert lost.callbacks == []


def test_a_connection_lost_before_the_block_cancels_it_once_it_waits() -> None:
    lost = Disconnect()
    lost.fire()
    assert guarded({DISCONNECT: lost}) == (True, "the task went on")


def test_a_callback_after_the_block_does_nothing_and_none_is_left_registered() -> None:
    lost = Disconnect()

    async def request() -> str:
        with DisconnectGuard(_never, {DISCONNECT: lost}):
            await asyncio.sleep(0)
        assert lost.callbacks == [], "the guard deregistered at the end of its block"
        lost.fire()  # the client leaves later (keep-alive): nothing of this request to cancel
        await asyncio.sleep(0.01)
        return "not cancelled"

    assert asyncio.run(request()) == "not cancelled"


def test_without_kilns_server_a_watcher_reads_the_disconnect_from_receive() -> None:
    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    assert guarded({}, receive) == (True, "the task went on")
    assert guarded({}) == (False, "the block ran to its end")

"""The gateway leaves the garbage collector little to do (kiln.server.collect_garbage_less_often):
what startup built is frozen, the young generation is collected after 10,000 net allocations,
and a finished stream is freed by reference counting, with no cycle left for the collector."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ADMIN_KEY, Gateway, Sim, catalog_toml, start_gateway, stop
from kiln.http import DISCONNECT, Disconnect, StreamOut, StreamResponse


class _Held:
    """Stands for what a stream's callbacks reach (the pipeline's run: translator, usage, ticket)."""


def _finished_stream_leaves(keepalive_s: float, frames: int, pause_s: float = 0.0) -> tuple[bool, int]:
    """Run one StreamResponse to its end with the collector off, waiting `pause_s` after each
    frame; (is what its callbacks held still alive, how many messages were sent)."""
    sent: list[dict[str, Any]] = []

    async def run() -> weakref.ref[_Held]:
        held = _Held()

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def produce(out: StreamOut, h: _Held = held) -> bytes:
            for _ in range(frames):
                await out.write(b"data: {}\n\n")
                await asyncio.sleep(pause_s)
            return b"data: [DONE]\n\n"

        response = StreamResponse(produce, {"X-Test": "1"}, lambda h=held: b": keepalive\n\n", keepalive_s)
        await response({"type": "http", DISCONNECT: Disconnect()}, receive, send)
        return weakref.ref(held)

    gc.collect()
    gc.disable()
    try:
        alive = asyncio.run(run())() is not None
    finally:
        gc.enable()
    return alive, len(sent)


def test_a_finished_stream_is_freed_without_the_collector() -> None:
    alive, sent = _finished_stream_leaves(keepalive_s=60.0, frames=20)
    assert sent == 22  # the start, 20 frames, the end
    assert not alive, "a finished stream's objects wait in a reference cycle for the garbage collector"


def test_a_stream_that_sent_keepalives_is_freed_too() -> None:
    alive, sent = _finished_stream_leaves(keepalive_s=0.05, frames=1, pause_s=0.075)  # a keepalive meanwhile
    assert sent >= 4  # the start, the frame, at least one keepalive, the end
    assert not alive, "a stream with a keepalive task is left in a reference cycle"


def test_startup_objects_are_frozen_and_young_collections_are_rare() -> None:
    code = ("import gc; from kiln.server import collect_garbage_less_often as c, GC_YOUNG_THRESHOLD as t; "
            "before = gc.get_threshold(); c(); print(gc.get_freeze_count() > 1000, gc.get_threshold()[0] == t, "
            "gc.get_threshold()[1:] == before[1:])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True"]


# -- through the gateway ------------------------------------------------------------------------------

# What a request's objects form no cycle with: each protocol's JSON answer and stream.
REQUESTS = [
    ("/v1/chat/completions", {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "qwen3-32b", "prompt": "hi", "max_tokens": 8}),
    ("/v1/responses", {"model": "qwen3-32b", "input": "hi"}),
    ("/v1/messages", {"model": "qwen3-32b", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}),
]


def collected(gateway: Gateway) -> float:
    """Objects the gateway's cycle collector freed so far, every generation (its /metrics)."""
    r = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
               if s.name == "python_gc_objects_collected_total")


@pytest.fixture
def fresh_gateway(sim: Sim) -> Iterator[Gateway]:
    """A gateway of its own: the session's shared one carries what earlier tests left for the
    collector (an error's traceback holds its frames in a cycle), which a collection that happens
    to come in this test's window would count against these requests (7,464 objects once in CI)."""
    gw = start_gateway(catalog_toml(sim.url))
    yield gw
    stop(gw.proc)


def test_requests_leave_no_cyclic_garbage(fresh_gateway: Gateway) -> None:
    """A request's objects die by reference counting when it ends. Any that form a cycle wait for
    the cycle collector, whose pauses (a young collection walks everything allocated since the
    last) were most of a single client's slowest requests: 13 objects a request (the connection's
    exchange and its scope, through the body reader the scope held) made a young collection every
    770 requests, up to 3 ms each. Before the fix, these requests fed it about 30,000 objects."""
    freed, count = _freed_over(fresh_gateway, 300, {})
    assert freed < count / 10, f"{freed:.0f} objects freed by the cycle collector over {count} requests"


def _freed_over(gateway: Gateway, rounds: int, extra: dict[str, str]) -> tuple[float, int]:
    """Every protocol's JSON answer and stream, `rounds` times: what the collector freed meanwhile."""
    tenant = gateway.new_key()
    before = collected(gateway)
    count = 0
    headers = {"Authorization": f"Bearer {tenant.key}", "x-api-key": tenant.key, **extra}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=30) as client:
        for _ in range(rounds):
            for path, body in REQUESTS:
                for stream in (False, True):
                    r = client.post(path, json={**body, "stream": stream})
                    assert r.status_code == 200, r.text
                    count += 1
    return collected(gateway) - before, count


def test_closed_connections_leave_no_cyclic_garbage(fresh_gateway: Gateway) -> None:
    """A client connection holds its HTTP parser, and the parser holds the connection's callbacks:
    a cycle, unless the connection lets its parser go when it closes. Agents and load generators
    open connection after connection; each closed one waited for the collector, and the old ones
    for a full collection: the gateway's RSS grew about 3 bytes a request over a million."""
    freed, count = _freed_over(fresh_gateway, 150, {"Connection": "close"})
    assert freed < count / 10, f"{freed:.0f} objects freed by the cycle collector over {count} connections"



def _cut_streams(gateway: Gateway, count: int, cut_by: str) -> float:
    """`count` chat streams cut short, by the backend (it closes the connection after three
    events) or by the client (it leaves after the first bytes): what the collector freed meanwhile."""
    tenant = gateway.new_key()
    body: dict[str, Any] = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    # The client leaves a stream still going: a token every 2 ms, 50 of them.
    body["sim"] = {"drop_after": 3} if cut_by == "backend" else {"token_delay_ms": 2, "reply_tokens": 50}
    before = collected(gateway)
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30) as client:
        for _ in range(count):
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                if cut_by == "client":
                    next(r.iter_raw())
                else:
                    assert b"data: {\"error\"" in r.read()  # the stream's in-band error
    return collected(gateway) - before


@pytest.mark.parametrize("cut_by", ["backend", "client"])
def test_streams_cut_short_leave_no_cyclic_garbage(fresh_gateway: Gateway, cut_by: str) -> None:
    """A backend connection closed mid-answer left two cycles: its HTTP parser holding its
    callbacks, and the stored error, raised, holding the frame that held the connection. 1,500
    streams the backend cut fed the collector 19,548 objects before the fix."""
    freed = _cut_streams(fresh_gateway, 1500, cut_by)
    assert freed < 150, f"{freed:.0f} objects freed by the cycle collector over 1,500 streams cut by the {cut_by}"

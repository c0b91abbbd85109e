"""Large buffers (agents' request bodies and their encodings) are kept off glibc's heap, where
each would leave a hole that the long-lived objects of open streams pin (kiln.server)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ADMIN_KEY, Gateway, Tenant
# In a fresh interpreter: where 100 blocks of 100 KB land, with the gateway's setting applied
# first or not. glibc's default threshold is 128 KiB, so by default the heap grows to hold
# them; with the setting, only what the heap's free top already holds is carved from it.
WHERE = """
import ctypes, sys
from kiln.server import keep_large_buffers_off_the_heap
applied = keep_large_buffers_off_the_heap() if sys.argv[1] == "apply" else False
blocks = [ctypes.create_string_buffer(100_000) for _ in range(100)]
heap = []
for line in open("/proc/self/maps"):
    span, rest = line.split(" ", 1)
    if rest.rstrip().endswith("[heap]"):
        heap.append(tuple(int(x, 16) for x in span.split("-")))
on_heap = sum(1 for b in blocks if any(lo <= ctypes.addressof(b) < hi for lo, hi in heap))
print(applied, "heap" if on_heap > 50 else "mapping")
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


def where(mode: str, env: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | (env or {})
    out = subprocess.run([sys.executable, "-c", WHERE, mode], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip()


def test_a_large_block_is_mapped_not_on_the_heap() -> None:
    assert where("default") == "False heap", "the premise: glibc puts a 100 KB block on its heap"
    assert where("apply") == "True mapping"


def test_an_operators_threshold_is_left_in_force() -> None:
    assert where("apply", {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}) == "False heap"



# -- cyclic garbage ------------------------------------------------------------------------------

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


def test_requests_leave_no_cyclic_garbage(gateway: Gateway, tenant: Tenant) -> None:
    """A request's objects die by reference counting when it ends. Any that form a cycle wait for
    the cycle collector, whose pauses (a young collection walks everything allocated since the
    last) were most of a single client's slowest requests: 13 objects a request (the connection's
    exchange and its scope, through the body reader the scope held) made a young collection every
    770 requests, up to 3 ms each. Before the fix, these requests fed it about 30,000 objects."""
    before = collected(gateway)
    count = 0
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {tenant.key}",
                                                    "x-api-key": tenant.key}, timeout=30) as client:
        for _ in range(300):
            for path, body in REQUESTS:
                for stream in (False, True):
                    r = client.post(path, json={**body, "stream": stream})
                    assert r.status_code == 200, r.text
                    count += 1
    freed = collected(gateway) - before
    assert freed < count / 10, f"{freed:.0f} objects freed by the cycle collector over {count} requests"

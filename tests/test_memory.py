"""Large buffers (agents' request bodies and their encodings) are kept off glibc's heap, where
each would leave a hole that the long-lived objects of open streams pin (kiln.server)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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


"""RedisAdmission has MemoryAdmission's semantics: the whole admission suite, on Redis.

The same tests as test_admission.py and test_count_tokens.py (credits, budgets, key spend limits
and their resets, rpm, tpm, concurrency, the 200-stream burst and its bound, count_tokens'
window, refusals in both protocols), run in a child pytest whose gateways use the machine's Redis
(a key prefix of their own) for admission, with the movable test clock reaching the Lua side. Their
store stays each gateway's SQLite file: admission is what is compared, and the suite's checks that
credits equal the events right after a request settles assume a store that commits in about a
millisecond (test_scaleout.py checks the same on PostgreSQL, once the commits are in).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from pathlib import Path

from kiln.core.resp import Resp

HERE = Path(__file__).parent


def test_admission_suite_passes_on_redis() -> None:
    prefix = f"kiln-test-parity-{secrets.token_hex(4)}"
    env = {**os.environ, "KILN_REDIS_URL": "redis://127.0.0.1:6379/0", "KILN_REDIS_PREFIX": prefix}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "test_admission.py", "test_count_tokens.py"],
                              cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
        assert " passed" in done.stdout and "failed" not in done.stdout
    finally:
        async def drop() -> None:
            redis, cursor = Resp("redis://127.0.0.1:6379/0"), "0"
            try:
                while True:  # the shared Redis: this test's keys only
                    cursor, keys = await redis.call("SCAN", cursor, "MATCH", f"{prefix}*", "COUNT", 1000)
                    if keys:
                        await redis.call("DEL", *keys)
                    if cursor == "0":
                        break
            finally:
                await redis.close()

        asyncio.run(drop())


def test_arguments_reach_redis_as_sent() -> None:
    """Every argument type the client frames, around the end of its table of length lines."""
    key = f"kiln-test-resp-{secrets.token_hex(4)}"
    args = ["ü✓", b"\x00\r\n", "x" * 511, "x" * 512, "é" * 300, 0, -1, 2**70, 1.5, 0.1, "", b""]

    async def go() -> list[str]:
        redis = Resp("redis://127.0.0.1:6379/0")
        try:
            await redis.call("RPUSH", key, *args)
            return await redis.call("LRANGE", key, 0, -1)  # type: ignore[no-any-return]
        finally:
            await redis.call("DEL", key)
            await redis.close()

    assert asyncio.run(go()) == ["ü✓", "\x00\r\n", "x" * 511, "x" * 512, "é" * 300, "0", "-1", str(2**70), "1.5",
                                 "0.1", "", ""]

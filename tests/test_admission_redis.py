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
REDIS_URL = "redis://127.0.0.1:6379/0"


async def _drop(redis: Resp, prefix: str) -> None:
    """Delete this test's keys from the shared Redis (its prefix's only)."""
    cursor = "0"
    while True:
        cursor, keys = await redis.call("SCAN", cursor, "MATCH", f"{prefix}*", "COUNT", 1000)
        if keys:
            await redis.call("DEL", *keys)
        if cursor == "0":
            break


def test_admission_suite_passes_on_redis() -> None:
    prefix = f"kiln-test-parity-{secrets.token_hex(4)}"
    env = {**os.environ, "KILN_REDIS_URL": REDIS_URL, "KILN_REDIS_PREFIX": prefix}
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "test_admission.py", "test_count_tokens.py"],
                              cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
        assert " passed" in done.stdout and "failed" not in done.stdout
    finally:
        async def drop() -> None:
            redis = Resp(REDIS_URL)
            try:
                await _drop(redis, prefix)
            finally:
                await redis.close()

        asyncio.run(drop())


def test_arguments_reach_redis_as_sent() -> None:
    """Every argument type the client frames, around the end of its table of length lines."""
    key = f"kiln-test-resp-{secrets.token_hex(4)}"
    args = ["ü✓", b"\x00\r\n", "x" * 511, "x" * 512, "é" * 300, 0, -1, 2**70, 1.5, 0.1, "", b""]

    async def go() -> list[str]:
        redis = Resp(REDIS_URL)
        try:
            await redis.call("RPUSH", key, *args)
            return await redis.call("LRANGE", key, 0, -1)  # type: ignore[no-any-return]
        finally:
            await redis.call("DEL", key)
            await redis.close()

    assert asyncio.run(go()) == ["ü✓", "\x00\r\n", "x" * 511, "x" * 512, "é" * 300, "0", "-1", str(2**70), "1.5",
                                 "0.1", "", ""]


def test_lease_expiries_are_whole_seconds_never_short_of_the_ttl() -> None:
    """The in-flight sets' scores (lease expiries) and the settled costs' times are integers: a small
    sorted set is a listpack, where an integer score is compared as one while a ZADD looks for its
    place and a fractional one is parsed from its text for every member (3x the Redis CPU a ZADD)."""
    from kiln.core.admission_lua import LIBRARY

    prefix = f"kiln-test-lease-{secrets.token_hex(4)}"
    ttl = 10

    async def go() -> tuple[float, list[float], list[float]]:
        redis = Resp(REDIS_URL)
        try:
            await redis.call("FUNCTION", "LOAD", "REPLACE", LIBRARY)
            await redis.call("FCALL", "kiln_v1_load", 1, prefix, 0, "o1", "k1", "e1", 10**12, 1, 0, "never", 0, 0)
            await redis.call("SET", f"{prefix}:alive", 0)  # past the rebuild's grace
            seconds, micros = await redis.call("TIME")
            now = int(seconds) + int(micros) / 1e6
            for i in range(3):
                ok = await redis.call("FCALL", "kiln_v1_admit", 1, prefix, 0, "o1", "k1", f"g{i}", "p1", "m", "chat",
                                      "generate", -1, -1, -1, -1, -1, -1, -1, -1, "never", 100, "3.0", 50, 1, 1, 100,
                                      ttl)
                assert ok[0] == "ok", ok
            assert await redis.call("FCALL", "kiln_v1_extend", 1, prefix, 0, "g1", 10, "3.0", 30, -1, -1, ttl) == 10
            scores = []
            for zset in ("leases", "os:o1", "ks:k1"):
                flat = await redis.call("ZRANGE", f"{prefix}:{zset}", 0, -1, "WITHSCORES")
                scores += [float(s) for s in flat[1::2]]
            assert await redis.call("FCALL", "kiln_v1_settle", 1, prefix, 0, "g0", 400, 60) == 1
            settled = [float(s) for s in (await redis.call("ZRANGE", f"{prefix}:pendt", 0, -1, "WITHSCORES"))[1::2]]
            return now, scores, settled
        finally:
            await _drop(redis, prefix)
            await redis.close()

    now, scores, settled = asyncio.run(go())
    assert len(scores) == 9 and len(settled) == 1
    for score in scores:
        assert score == int(score), scores
        assert now + ttl <= score <= now + ttl + 2, (now, scores)  # rounded up: never short of the TTL
    assert settled[0] == int(settled[0]) and now - 1 <= settled[0] <= now + 1

"""Several replicas, several workers each: the same exact money and limits as one process.

Three gateway processes — two with `--workers 2`, one with a single worker —
on one PostgreSQL schema and one Redis, clients spread over all of them. The
Redis is a private one on a free port (tests stop and restart it); the
PostgreSQL outage test runs its own PostgreSQL too. The machine's shared
servers are never stopped.

KILN_SOAK=1 runs the long variants (a 60 s database outage, longer loads).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Iterator

import asyncpg
import httpx
import pytest

from conftest import (PG_DSN as DSN, Gateway, Sim, catalog_toml, drop_pg_schema, kill_hard, start_gateway, start_sim,
                      stop, wait_for)
from services import PostgresServer, RedisServer

SOAK = os.environ.get("KILN_SOAK") == "1"
OUT_PRICE = Decimal("0.30") / 1_000_000  # qwen3-32b output, USD per token
NANO = Decimal(10) ** 9
MSG = [{"role": "user", "content": "Write a long story."}]


@dataclass
class Cluster:
    sim: Sim
    redis: RedisServer
    dsn: str  # the schema's DSN, as the gateways use it
    schema: str
    env: dict[str, str]
    config: str
    replicas: list[Gateway]

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.replicas]

    @property
    def admin(self) -> httpx.Client:
        return self.replicas[0].admin

    def new_key(self, **org: Any) -> Any:
        key_fields = org.pop("key_fields", None)
        tenant = self.replicas[0].new_key(key_fields=key_fields, **{"rpm_limit": 100000, **org})
        auth = {"Authorization": f"Bearer {tenant.key}"}
        for url in self.urls:  # every replica and worker knows the key (notices reach them within a second)
            wait_for(lambda: all(httpx.get(url + "/v1/key", headers=auth, timeout=10).status_code == 200
                                 for _ in range(3)), timeout=10, what=f"the new key on {url}")
        return tenant

    def start_replica(self, workers: int) -> Gateway:
        return start_gateway(self.config, env=self.env, args=("--workers", str(workers)) if workers > 1 else ())


def query(dsn: str, schema: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn, server_settings={"search_path": schema})
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


def ledger(cluster: Cluster, org_id: str) -> tuple[int, int, int, dict[str, tuple[int, str]]]:
    """From PostgreSQL: credits granted, credits left, the sum of events, and the events by id."""
    granted = query(cluster.dsn, cluster.schema, "SELECT COALESCE(SUM(amount_nano), 0) FROM credit_grants"
                    " WHERE org_id = $1", org_id)[0][0]
    credits = query(cluster.dsn, cluster.schema, "SELECT credits_nano FROM orgs WHERE id = $1", org_id)[0][0]
    rows = query(cluster.dsn, cluster.schema, "SELECT id, cost_nano, status FROM usage_events WHERE org_id = $1",
                 org_id)
    return int(granted), int(credits), sum(int(r[1]) for r in rows), {r[0]: (int(r[1]), r[2]) for r in rows}


def assert_credits_match_events(cluster: Cluster, org_id: str) -> int:
    granted, credits, spent, _ = ledger(cluster, org_id)
    assert granted - credits == spent, (granted, credits, spent)
    return spent


def make_cluster(sim: Sim, redis: RedisServer, dsn: str, schema: str, extra_server: str = "") -> Cluster:
    config = catalog_toml(sim.url).replace("[server]\n", f"[server]\nledger_wait_s = 5\n{extra_server}", 1)
    env = {"KILN_DATABASE": f"{dsn}?schema={schema}", "KILN_REDIS_URL": redis.url,
           "KILN_REDIS_PREFIX": f"kiln-test-{schema}"}
    cluster = Cluster(sim, redis, dsn, schema, env, config, [])
    cluster.replicas = [cluster.start_replica(2), cluster.start_replica(2), cluster.start_replica(1)]
    return cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    sim = start_sim("--model", "Qwen/Qwen3-32B", "--model", "gpt-oss-120b")
    redis = RedisServer()
    redis.start()
    schema = f"kiln_scale_{secrets.token_hex(4)}"
    c = make_cluster(sim, redis, DSN, schema)
    yield c
    for g in c.replicas:
        stop(g.proc)
    redis.stop()
    stop(sim.proc)
    drop_pg_schema(schema)


def clients(cluster: Cluster, key: str, **kw: Any) -> list[httpx.AsyncClient]:
    """One client per replica; no keep-alive, so requests spread over each replica's workers too."""
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=0)
    return [httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60, limits=limits,
                              **kw) for url in cluster.urls]


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, httpx.Headers, list[str]]:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.headers, [r.text]
        return 200, r.headers, [line async for line in r.aiter_lines() if line.startswith("data: ")]


async def _spread(cluster: Cluster, key: str, n: int, body: dict[str, Any], at_once: int = 1000
                  ) -> list[tuple[int, httpx.Headers, list[str]]]:
    cs = clients(cluster, key)
    gate = asyncio.Semaphore(at_once)

    async def one(i: int) -> tuple[int, httpx.Headers, list[str]]:
        async with gate:
            return await _stream(cs[i % len(cs)], body)

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        await asyncio.gather(*(c.aclose() for c in cs))


def in_flight(cluster: Cluster, org_id: str) -> int:
    return int(cluster.admin.get(f"/orgs/{org_id}").json()["in_flight"])


# -- limits across replicas ---------------------------------------------------------------


def test_200_slow_streams_over_three_replicas_never_exceed_8_in_flight(cluster: Cluster) -> None:
    t = cluster.new_key(concurrency_limit=8)
    cluster.sim.reset()
    body = {"model": "qwen3-32b", "messages": MSG, "stream": True, "max_tokens": 40,
            "sim": {"reply_tokens": 40, "token_delay_ms": 100}}
    results = asyncio.run(_spread(cluster, t.key, 200, body))
    ok = [r for r in results if r[0] == 200]
    limited = [r for r in results if r[0] == 429]
    assert len(ok) + len(limited) == 200, {r[0] for r in results}
    assert cluster.sim.stats()["max_in_flight"] <= 8
    assert len(ok) >= 8
    assert all('"rate_limit_exceeded"' in lines[0] for _, _, lines in limited)
    assert not any(k.startswith("x-ratelimit") for _, h, _ in limited for k in h), "no rate-limit headers"
    assert all(lines[-1] == "data: [DONE]" for _, _, lines in ok)
    wait_for(lambda: in_flight(cluster, t.org_id) == 0, timeout=10, what="slots released")
    assert len(t.usage()) == len(ok)
    assert_credits_match_events(cluster, t.org_id)


def test_60_requests_per_minute_hold_across_replicas(cluster: Cluster) -> None:
    t = cluster.new_key(rpm_limit=60, concurrency_limit=500)
    body = {"model": "qwen3-32b", "messages": MSG, "max_tokens": 3}
    results = asyncio.run(_spread(cluster, t.key, 100, body, at_once=25))
    ok = [r for r in results if r[0] == 200]
    limited = [r for r in results if r[0] == 429]
    assert len(ok) == 60 and len(limited) == 40, sorted({r[0] for r in results})
    for _, headers, _ in limited:
        assert headers["x-ratelimit-limit-requests"] == "60"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        reset = int(headers["x-ratelimit-reset"])
        assert 0 < reset <= 60 and headers["retry-after"] == str(reset)
    assert len(t.usage()) == 60, "a 429 is not billed"


def test_burst_of_200_streams_over_replicas_never_overspends_a_small_budget(cluster: Cluster) -> None:
    budget = Decimal("0.002")
    t = cluster.new_key(credits="10", monthly_budget=str(budget), concurrency_limit=500)
    body = {"model": "qwen3-32b", "messages": MSG, "stream": True, "max_tokens": 128000,
            "sim": {"reply_tokens": 1500, "token_delay_ms": 2}}
    results = asyncio.run(_spread(cluster, t.key, 200, body))
    admitted = [lines for status, _, lines in results if status == 200]
    refused = [lines for status, _, lines in results if status != 200]
    assert {status for status, _, _ in results} <= {200, 402}
    assert admitted and refused
    assert all('"budget_exceeded"' in lines[0] for lines in refused)
    assert all(lines[-1] == "data: [DONE]" for lines in admitted)
    spent = Decimal(assert_credits_match_events(cluster, t.org_id)) / NANO
    bound = len(admitted) * 8 * OUT_PRICE  # the documented bound: one chunk per stream in flight
    print(f"\nburst over 3 replicas: {len(admitted)} admitted, {len(refused)} refused; spend {spent} of {budget}")
    assert spent <= budget + bound, (spent, budget, bound)
    assert spent > budget * Decimal("0.8"), "the money is used, not stranded in reservations"
    assert len(t.usage()) == len(admitted)


def test_changes_reach_every_replica_within_a_second(cluster: Cluster) -> None:
    """Revocation, maintenance and a credit top-up made on one replica hold on all of them in 1 s."""
    t = cluster.new_key(credits="0")
    body = {"model": "qwen3-32b", "messages": MSG, "max_tokens": 3}

    def statuses() -> set[int]:
        """Four requests to each replica at once, on new connections (so: to each of its workers)."""
        async def probe() -> set[int]:
            cs = clients(cluster, t.key)
            try:
                answers = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for c in cs * 4))
            finally:
                await asyncio.gather(*(c.aclose() for c in cs))
            return {r.status_code for r in answers}

        return asyncio.run(probe())

    assert statuses() == {402}
    started = time.monotonic()
    assert cluster.replicas[1].admin.post(f"/orgs/{t.org_id}/credits", json={"amount": "1"}).status_code == 200
    wait_for(lambda: statuses() == {200}, timeout=5, what="the top-up on every replica")
    topped_up = time.monotonic() - started
    until = time.time() + 600
    started = time.monotonic()
    assert cluster.replicas[2].admin.put("/maintenance", json={"until": until}).status_code == 200
    try:
        wait_for(lambda: statuses() == {503}, timeout=5, what="maintenance on every replica")
        maintenance = time.monotonic() - started
    finally:
        cluster.admin.put("/maintenance", json={"until": None})
    wait_for(lambda: statuses() == {200}, timeout=5, what="maintenance over everywhere")
    started = time.monotonic()
    assert cluster.admin.post(f"/keys/{t.key_id}/revoke").status_code == 200
    wait_for(lambda: statuses() == {403}, timeout=5, what="the revocation on every replica")
    revoked = time.monotonic() - started
    print(f"\npropagation: top-up {topped_up:.2f} s, maintenance {maintenance:.2f} s, revocation {revoked:.2f} s")
    assert max(topped_up, maintenance, revoked) <= 1.0 + 0.5 * (not SOAK)  # the probe itself takes time


# -- failures -------------------------------------------------------------------------------


def test_killed_replica_frees_its_slots_and_its_streams_are_billed_once(cluster: Cluster) -> None:
    t = cluster.new_key(concurrency_limit=6)
    doomed = cluster.start_replica(2)
    body = {"model": "qwen3-32b", "messages": MSG, "stream": True, "max_tokens": 8000,
            "sim": {"reply_tokens": 6000, "token_delay_ms": 4}}
    gens: list[str] = []

    async def start_streams() -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=doomed.url, headers={"Authorization": f"Bearer {t.key}"},
                                     timeout=60, limits=limits) as c:
            past_extension: list[str] = []

            async def one() -> None:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    gen = r.headers["x-neocloud-generation-id"]
                    gens.append(gen)
                    chunks = 0
                    async for line in r.aiter_lines():  # until the replica dies under it
                        chunks += line.startswith("data: ")
                        if chunks == 700:  # past the first 512-token extension
                            past_extension.append(gen)

            tasks = [asyncio.ensure_future(one()) for _ in range(6)]
            while len(past_extension) < 6:
                assert not any(task.done() for task in tasks), [task.exception() for task in tasks if task.done()]
                await asyncio.sleep(0.1)
            await asyncio.sleep(1)
            kill_hard(doomed.proc)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(start_streams())
    killed = time.monotonic()
    assert len(gens) == 6
    refused = httpx.post(cluster.urls[0] + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 3},
                         headers={"Authorization": f"Bearer {t.key}"}, timeout=10)
    assert refused.status_code == 429, "the dead replica's slots still count until their leases expire"
    wait_for(lambda: in_flight(cluster, t.org_id) == 0, timeout=20, what="the dead replica's slots freed")
    freed = time.monotonic() - killed
    wait_for(lambda: all(g in ledger(cluster, t.org_id)[3] for g in gens), timeout=15, what="lost streams billed")
    events = ledger(cluster, t.org_id)[3]
    print(f"\nslots freed {freed:.1f} s after kill -9; lost streams billed: {[events[g] for g in gens]}")
    assert freed <= 15
    one_block = 512 * OUT_PRICE * NANO
    for gen in gens:
        cost, status = events[gen]
        assert status == "lost"
        assert one_block * Decimal("0.95") <= cost < 6000 * OUT_PRICE * NANO, cost
    assert len(query(cluster.dsn, cluster.schema, "SELECT id FROM usage_events WHERE id = ANY($1::text[])", gens)) == 6
    assert_credits_match_events(cluster, t.org_id)
    results = asyncio.run(_spread(cluster, t.key, 6, {**body, "max_tokens": 5}))
    assert [r[0] for r in results] == [200] * 6, "every slot is free again"


async def _load(cluster: Cluster, key: str, body: dict[str, Any], stop_at: list[float], n: int
                ) -> list[tuple[float, int, str, httpx.Headers]]:
    """`n` clients sending `body` over the replicas until time.monotonic() passes stop_at[0]."""
    cs = clients(cluster, key)
    seen: list[tuple[float, int, str, httpx.Headers]] = []
    rotation = itertools.cycle(cs)

    async def loop() -> None:
        while time.monotonic() < stop_at[0]:
            c = next(rotation)
            try:
                r = await c.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                seen.append((time.monotonic(), -1, type(exc).__name__, httpx.Headers()))
                continue
            seen.append((time.monotonic(), r.status_code,
                         r.headers.get("x-neocloud-generation-id", "") if r.status_code == 200 else r.text[:300],
                         r.headers))
            if r.status_code != 200:
                await asyncio.sleep(0.05)

    try:
        await asyncio.gather(*(loop() for _ in range(n)))
    finally:
        await asyncio.gather(*(c.aclose() for c in cs))
    return seen


def test_redis_restart_under_load_fails_closed_then_holds_the_budget(cluster: Cluster) -> None:
    budget = Decimal("0.004")
    t = cluster.new_key(credits="10", monthly_budget=str(budget), concurrency_limit=4)
    body = {"model": "qwen3-32b", "messages": MSG, "max_tokens": 200, "sim": {"reply_tokens": 200, "ttft_ms": 50,
                                                                              "token_delay_ms": 1}}
    stop_at = [time.monotonic() + 60]
    marks: dict[str, float] = {}

    async def scenario() -> list[tuple[float, int, str, httpx.Headers]]:
        load = asyncio.ensure_future(_load(cluster, t.key, body, stop_at, 10))
        await asyncio.sleep(2)
        marks["down"] = time.monotonic()
        await asyncio.to_thread(cluster.redis.stop)
        await asyncio.sleep(3)
        marks["health_down"] = httpx.get(cluster.urls[2] + "/health", timeout=5).status_code
        await asyncio.to_thread(cluster.redis.start)
        marks["up"] = time.monotonic()
        cluster.sim.reset()
        await asyncio.sleep(12 if SOAK else 8)
        stop_at[0] = 0
        return await load

    seen = asyncio.run(scenario())
    assert marks["health_down"] == 503, "/health says degraded while Redis is away"
    for url in cluster.urls:
        wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, timeout=10, what="health ok")
    outage = [s for s in seen if marks["down"] + 0.5 < s[0] < marks["up"]]
    after = [s for s in seen if s[0] > marks["up"] + 4]
    assert {s[1] for s in seen} <= {200, 402, 429, 503}, sorted({(s[1], s[2]) for s in seen})
    assert outage and {s[1] for s in outage} <= {200, 503} and any(s[1] == 503 for s in outage)
    assert all("retry-after" in s[3] for s in seen if s[1] == 503)
    assert any(s[1] == 200 for s in after) or any(s[1] == 402 for s in after), "admission recovers by itself"
    ok = [s[2] for s in seen if s[1] == 200]
    spent = Decimal(assert_credits_match_events(cluster, t.org_id)) / NANO
    events = ledger(cluster, t.org_id)[3]
    assert all(g in events for g in ok) and len(set(ok)) == len(ok), "every response billed, none twice"
    assert spent <= budget + 4 * 8 * OUT_PRICE, (spent, budget)
    assert cluster.sim.stats()["max_in_flight"] <= 4, "the concurrency limit holds after the rebuild"
    print(f"\nRedis restart: {sum(s[1] == 503 for s in seen)} x 503 during the outage, {len(ok)} served,"
          f" spend {spent} of {budget}")


def test_workers_without_shared_state_refuse_to_start(tmp_path: Any) -> None:
    config = tmp_path / "kiln.toml"
    config.write_text(catalog_toml("http://127.0.0.1:9"))
    cmd = [sys.executable, "-m", "kiln", "serve", "--config", str(config), "--data-dir", str(tmp_path),
           "--workers", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_REDIS_URL", "KILN_DATABASE")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 2
    assert "redis_url" in done.stderr and "KILN_REDIS_URL" in done.stderr
    assert "server.database" in done.stderr and "SQLite" in done.stderr
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                          env={**env, "KILN_REDIS_URL": "redis://127.0.0.1:6379/0"})
    assert done.returncode == 2 and "redis_url" not in done.stderr and "PostgreSQL" in done.stderr


# -- PostgreSQL unreachable --------------------------------------------------------------------


def test_database_outage_serves_known_keys_and_loses_no_event() -> None:
    pg = PostgresServer()
    pg.start()
    sim = start_sim("--model", "Qwen/Qwen3-32B", "--model", "gpt-oss-120b")
    redis = RedisServer()
    redis.start()
    cluster = make_cluster(sim, redis, pg.dsn, "kiln_outage", extra_server="refresh_s = 0.5\n")
    try:
        t = cluster.new_key(credits="10", concurrency_limit=64)
        body = {"model": "qwen3-32b", "messages": MSG, "max_tokens": 10, "sim": {"reply_tokens": 10}}
        outage_s = 60 if SOAK else 8
        stop_at = [time.monotonic() + 3600]
        marks: dict[str, float] = {}
        unknown: list[int] = []

        async def scenario() -> list[tuple[float, int, str, httpx.Headers]]:
            load = asyncio.ensure_future(_load(cluster, t.key, body, stop_at, 6))
            await asyncio.sleep(2)
            await asyncio.to_thread(pg.stop)
            marks["down"] = time.monotonic()
            await asyncio.sleep(2)  # the poll notices
            async with httpx.AsyncClient(base_url=cluster.urls[1], timeout=10) as c:
                r = await c.post("/v1/chat/completions", json=body,
                                 headers={"Authorization": "Bearer sk-kiln-not-seen-" + "x" * 30})
                unknown.append(r.status_code)
            await asyncio.sleep(outage_s - 2)
            await asyncio.to_thread(pg.start)
            marks["up"] = time.monotonic()
            await asyncio.sleep(3)
            stop_at[0] = 0
            return await load

        seen = asyncio.run(scenario())
        during = [s for s in seen if marks["down"] < s[0] < marks["up"]]
        assert unknown == [503], "a key not seen while the database is down is a 503, not a 401"
        assert 401 not in {s[1] for s in seen}, "never a 401 for a valid key"
        assert during and all(s[1] == 200 for s in during), sorted({(s[1], s[2]) for s in during if s[1] != 200})
        ok = [s[2] for s in seen if s[1] == 200]
        wait_for(lambda: len(ledger(cluster, t.org_id)[3]) >= len(ok), timeout=30, what="the spools written back")
        events = ledger(cluster, t.org_id)[3]
        assert set(ok) == set(events) and len(ok) == len(events), "every completed response has exactly one event"
        assert_credits_match_events(cluster, t.org_id)
        print(f"\ndatabase down {outage_s} s: {len(during)} requests served meanwhile, {len(ok)} in all, "
              f"{len(events)} events after")
    finally:
        for g in cluster.replicas:
            stop(g.proc)
        redis.stop()
        stop(sim.proc)
        pg.destroy()

"""kill -9 in the middle of mixed load: the ledger holds every completed response once.

1,000 requests (10,000 with --soak) of the four protocols, JSON and stream, 16 at a
time, while the gateway is killed with SIGKILL three times (ten with --soak) and
restarted on the same data directory. Afterwards every completed response (a 200 JSON
body with a generation id, or a stream that reached its final event) has exactly one
usage event, and the organisation's credits consumed equal the sum of its events.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from decimal import Decimal

import httpx

from conftest import QWEN_UPSTREAM, Gateway, Tenant, catalog_toml, start_gateway, start_sim, stop
from reliability.harness import PATHS, Answer, body_for, observe

CONCURRENCY = 16
PROTOCOLS = ("chat", "completions", "responses", "messages")


class Load:
    """The running load: where the gateway is now, and what each request got."""

    def __init__(self, gw: Gateway, tenant: Tenant, total: int) -> None:
        self.gw, self.tenant, self.total = gw, tenant, total
        self.up = asyncio.Event()
        self.up.set()
        self.next = 0
        self.answers: list[Answer] = []

    async def worker(self) -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            while self.next < self.total:
                i = self.next
                self.next += 1
                await self.up.wait()
                protocol, stream = PROTOCOLS[i % 4], bool((i // 4) % 2)
                self.answers.append(await self.one(client, protocol, stream, i))

    async def one(self, client: httpx.AsyncClient, protocol: str, stream: bool, i: int) -> Answer:
        body = body_for(protocol, "qwen3-32b", f"request {i}", stream, 64)
        headers = {"Authorization": f"Bearer {self.tenant.key}", "anthropic-version": "2023-06-01"}
        started = time.monotonic()
        status, got, raw, failure = 0, {}, b"", ""
        try:
            async with client.stream("POST", self.gw.url + PATHS[protocol], json=body, headers=headers) as resp:
                status, got = resp.status_code, {k.lower(): v for k, v in resp.headers.items()}
                chunks = []
                try:
                    async for piece in resp.aiter_raw():
                        chunks.append(piece)
                except httpx.HTTPError as exc:
                    failure = type(exc).__name__
                raw = b"".join(chunks)
        except httpx.HTTPError as exc:
            failure = type(exc).__name__
        return Answer(protocol, stream, status, got, raw, time.monotonic() - started, failure)


def completed(a: Answer) -> bool:
    if a.status != 200 or not a.generation_id or a.failure:
        return False
    if not a.stream:
        try:
            return isinstance(a.json(), dict)
        except ValueError:
            return False
    return a.ending == "complete"


async def _run(load: Load, kills: int, config: str) -> list[float]:
    """Run the load; kill -9 and restart the gateway `kills` times at even points."""
    workers = [asyncio.create_task(load.worker()) for _ in range(CONCURRENCY)]
    restarts = []
    for k in range(1, kills + 1):
        while len(load.answers) < load.total * k // (kills + 1):
            await asyncio.sleep(0.01)
        load.gw.proc.send_signal(signal.SIGKILL)
        load.up.clear()
        load.gw.proc.wait()
        started = time.monotonic()
        load.gw = await asyncio.to_thread(start_gateway, config, data_dir=load.gw.data_dir)
        restarts.append(time.monotonic() - started)
        load.up.set()
    await asyncio.gather(*workers)
    return restarts


def test_kill_9_under_mixed_load_loses_no_completed_response(soak: bool) -> None:
    total, kills = (10_000, 10) if soak else (1_000, 3)
    sim = start_sim("--model", QWEN_UPSTREAM, "--model", "gpt-oss-120b", "--token-delay-ms", "2")
    config = catalog_toml(sim.url)
    gw = start_gateway(config)
    try:
        tenant = gw.new_key(credits="100")
        load = Load(gw, tenant, total)
        started = time.monotonic()
        restarts = asyncio.run(_run(load, kills, config))
        seconds = time.monotonic() - started
        t = Tenant(load.gw, tenant.org_id, tenant.project_id, tenant.key_id, tenant.key)
        events = load.gw.admin.get("/usage", params={"key_id": t.key_id, "limit": 10_000}).json()["data"]
        org = t.org()
    finally:
        stop(load.gw.proc if "load" in locals() else gw.proc)
        stop(sim.proc)
    ids = Counter(e["id"] for e in events)
    done = [a for a in load.answers if completed(a)]
    missing = [a.generation_id for a in done if ids[a.generation_id or ""] == 0]
    doubled = [i for i, n in ids.items() if n > 1]
    costs = sum((Decimal(e["cost"]) for e in events), Decimal(0))
    by_kind: Counter[str] = Counter(f"{a.protocol}/{'stream' if a.stream else 'json'}" for a in done)
    observe("kill-9", requests=total, kills=kills, seconds=round(seconds, 1),
            restart_seconds=[round(r, 2) for r in restarts], completed=len(done), completed_by_kind=dict(by_kind),
            not_completed=total - len(done), events=len(events), missing=len(missing), doubled=len(doubled),
            total_spend=org["total_spend"], credits=org["credits"], granted=org["total_granted"])
    assert len(load.answers) == total
    assert len(done) >= total * 0.8, f"only {len(done)} of {total} completed"
    assert not missing, f"{len(missing)} completed responses have no usage event: {missing[:5]}"
    assert not doubled, f"events recorded twice: {doubled[:5]}"
    assert Decimal(org["total_spend"]) == costs
    assert Decimal(org["credits"]) == Decimal(org["total_granted"]) - costs
    assert org["usage_events"] == len(events)

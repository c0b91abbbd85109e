"""The ledger under faults: one bad event never wedges it, a full disk never hangs a request.

The bad-event tests drive the real Ledger on the real stores (SQLite and the
machine's PostgreSQL, a schema of its own) in this process: an event whose
cost no BIGINT holds is the bad one. The disk-full test runs a real gateway
whose data directory is a 4 MiB tmpfs, filled up while it serves: a real
ENOSPC under SQLite, as on a full disk (a file-size rlimit would raise a
different error and SIGXFSZ; SQLite's max_page_count would fail the file's
growth but not its WAL's).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import PG_DSN as DSN, Sim, catalog_toml, drop_pg_schema, start_gateway, stop, wait_for
from kiln.core.accounts import Accounts
from kiln.core.journal import Journal
from kiln.core.ledger import LINGER_EVENTS, Ledger
from kiln.core.records import UsageEvent
from kiln.store.postgres import PostgresStore
from kiln.store.sqlite import SQLiteStore, _tx as sqlite3_tx


@pytest.fixture(params=["sqlite", "postgres"])
def store_factory(request: Any, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        yield lambda: SQLiteStore(tmp_path / "kiln.db")
        return
    schema = f"kiln_ledger_{secrets.token_hex(4)}"
    yield lambda: PostgresStore(DSN, schema)

    drop_pg_schema(schema)


def _events(org_id: str, project_id: str, key_id: str, n: int) -> list[UsageEvent]:
    return [UsageEvent(id=f"gen-{secrets.token_hex(6)}", created_at=time.time(), org_id=org_id,
                       project_id=project_id, key_id=key_id, model="m", endpoint="chat.completions",
                       prompt_tokens=10, completion_tokens=5, cost_nano=1000) for _ in range(n)]


def test_a_bad_event_is_set_aside_and_the_rest_commit(store_factory: Any, tmp_path: Path) -> None:
    async def run() -> None:
        store = store_factory()
        await store.open()
        accounts = Accounts(store)
        org = await accounts.create_org("o")
        await accounts.add_credits(org.id, 1_000_000_000)
        project = await accounts.create_project(org.id, "p")
        key, _ = await accounts.create_key(project.id)
        ledger = Ledger(store, dead_letter_file=tmp_path / "dead-letters.jsonl")
        await ledger.start()
        try:
            events = _events(org.id, project.id, key.id, 40)
            events[17].cost_nano = 2**70  # no BIGINT holds it
            await asyncio.wait_for(asyncio.gather(*[ledger.submit(e) for e in events]), 20)  # one batch
            totals = await store.usage_totals(org.id)
            assert totals["events"] == 39 and totals["cost_nano"] == 39 * 1000
            assert (await store.balances(org.id, key.id, 0.0, None)).credits_nano == 1_000_000_000 - 39 * 1000
            assert ledger.stats["dead_lettered"] == 1 and not ledger.degraded
            assert await _dead_letters(store) == [events[17].id]
            # The ledger goes on, and a batch written twice bills once.
            more = _events(org.id, project.id, key.id, 3)
            await asyncio.wait_for(asyncio.gather(*[ledger.submit(e) for e in more]), 10)
            assert await store.record_usage(more + events[:5]) == {}, "nothing was inserted, nothing moved"
            totals = await store.usage_totals(org.id)
            assert totals["events"] == 42 and totals["cost_nano"] == 42 * 1000
        finally:
            await ledger.stop()
            await store.close()

    asyncio.run(run())


async def _sqlite_with_events(tmp_path: Path, n: int) -> tuple[SQLiteStore, list[UsageEvent]]:
    """An open SQLite store with one funded organisation, and `n` usage events of its key."""
    store = SQLiteStore(tmp_path / "kiln.db")
    await store.open()
    accounts = Accounts(store)
    org = await accounts.create_org("o")
    await accounts.add_credits(org.id, 1_000_000_000)
    key, _ = await accounts.create_key((await accounts.create_project(org.id, "p")).id)
    return store, _events(org.id, key.project_id, key.id, n)


def test_a_commit_on_the_event_loop_never_shares_the_connection(tmp_path: Path) -> None:
    """Small batches commit on the event loop while the store's thread is idle; while the thread
    runs a call (here one that takes 0.3 s), they go to the thread and wait their turn, instead of
    starting a transaction on the connection the thread is using."""
    async def run() -> None:
        store, events = await _sqlite_with_events(tmp_path, 2)
        try:
            def slow(db: Any) -> int:
                with sqlite3_tx(db):
                    time.sleep(0.3)
                    return db.execute("SELECT count(*) FROM usage_events").fetchone()[0]

            slow_call = asyncio.ensure_future(store._run(slow))
            await asyncio.sleep(0.05)  # the slow call is in the thread
            started = time.monotonic()
            await store.record_usage(events[:1])
            assert time.monotonic() - started > 0.2, "the commit waited for the thread"
            assert await slow_call == 0
            await store.record_usage(events[1:])  # the thread is idle again: on the loop
            totals = await store.usage_totals(events[0].org_id)
            assert totals["events"] == 2 and totals["cost_nano"] == 2000
        finally:
            await store.close()

    asyncio.run(run())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are per thread on Linux only")
def test_the_store_thread_yields_the_cpu_to_the_event_loop(tmp_path: Path) -> None:
    """The thread that commits journaled batches runs in the idle scheduling class, so a request
    that arrives during a commit is served at once: at nice 10 the kernel (EEVDF) let the running
    commit finish its time slice first, a stall of 1.5-4.5 ms every commit (a tenth of a second)
    for a single client. The event loop's own thread keeps its class."""
    async def run() -> None:
        store, events = await _sqlite_with_events(tmp_path, 1)
        try:
            def policy(_: Any) -> int:
                return os.sched_getscheduler(threading.get_native_id())

            loop_policy = os.sched_getscheduler(threading.get_native_id())
            assert await store._run(policy) == os.SCHED_IDLE
            assert os.sched_getscheduler(threading.get_native_id()) == loop_policy == os.SCHED_OTHER
            await store.record_usage(events, waited=False)  # a journaled batch: in that thread
            assert (await store.usage_totals(events[0].org_id))["events"] == 1
        finally:
            await store.close()

    asyncio.run(run())


async def _dead_letters(store: Any) -> list[str]:
    if isinstance(store, SQLiteStore):
        return await store._run(lambda db: [r[0] for r in db.execute("SELECT event_id FROM usage_dead_letters")])
    return [r[0] for r in await store._pool.fetch("SELECT event_id FROM usage_dead_letters")]


@pytest.fixture
def small_disk() -> Iterator[Path]:
    mount = Path(tempfile.mkdtemp(prefix="kiln-full-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_journaled_batch_commits_off_the_event_loop(tmp_path: Path) -> None:
    """No request waits for a journaled batch (its events are durable in the journal): it commits
    in the store's thread while the loop serves requests. A small batch a request waits for
    commits on the loop, without the hop to the thread."""
    async def run() -> None:
        store, events = await _sqlite_with_events(tmp_path, 2)
        loop = asyncio.get_running_loop()
        try:
            ran: list[int] = []
            loop.call_soon(ran.append, 1)
            await store.record_usage(events[:1], waited=False)
            assert ran, "the loop ran other work while the journaled batch committed"
            ran.clear()
            loop.call_soon(ran.append, 1)
            await store.record_usage(events[1:])
            assert not ran, "a waited-for batch of one committed on the loop, at once"
            totals = await store.usage_totals(events[0].org_id)
            assert totals["events"] == 2 and totals["cost_nano"] == 2000
        finally:
            await store.close()

    asyncio.run(run())


def test_a_request_journals_while_a_journaled_batch_commits(tmp_path: Path) -> None:
    """No one waits for a batch of journaled events: a request that comes while it commits (held
    here for 0.3 s by a slow call in the store's thread) journals its own event and goes on,
    instead of waiting for that commit and the one after it."""
    async def run() -> None:
        store, events = await _sqlite_with_events(tmp_path, 3)
        ledger = Ledger(store, linger_s=0.01, journal=Journal(tmp_path / "journal"))
        await ledger.start()
        try:
            def slow(db: Any) -> None:
                time.sleep(0.3)

            await ledger.record(events[0])  # journaled: the writer lingers, then commits it
            busy = asyncio.ensure_future(store._run(slow))
            await asyncio.sleep(0.1)  # the commit of events[0] is under way, behind the slow call
            assert ledger._batch, "the commit is under way"
            started = time.monotonic()
            await ledger.record(events[1])
            assert time.monotonic() - started < 0.1, "journaled, not queued behind the commit"
            await busy
            await ledger.settled()
            totals = await store.usage_totals(events[0].org_id)
            assert totals["events"] == 2 and totals["cost_nano"] == 2000
        finally:
            await ledger.stop()
            await store.close()

    asyncio.run(run())


def test_journaling_stops_at_a_backlog_and_requests_wait_for_their_commit(tmp_path: Path) -> None:
    """Journaled events wait for a commit that no request waits for, in a thread that yields the
    CPU to the event loop: under full load that commit can fall behind. Once LINGER_EVENTS are
    queued or committing, a request waits for its commit instead of journaling (back-pressure),
    so the backlog, and the memory it holds, stays bounded."""
    async def run() -> None:
        store, events = await _sqlite_with_events(tmp_path, LINGER_EVENTS + 1)
        ledger = Ledger(store, linger_s=60, journal=Journal(tmp_path / "journal"))
        await ledger.start()
        try:
            for event in events[:LINGER_EVENTS]:  # journaled: each returns without a commit
                await ledger.record(event)
            assert ledger.depth == LINGER_EVENTS
            await ledger.record(events[-1])  # the backlog is full: this one waits for its commit
            assert await store.get_usage(events[-1].id) is not None
            await ledger.settled()
            assert (await store.usage_totals(events[0].org_id))["events"] == LINGER_EVENTS + 1
        finally:
            await ledger.stop()
            await store.close()

    asyncio.run(run())


def test_disk_full_503s_after_a_bounded_wait_and_recovers(sim: Sim, small_disk: Path) -> None:
    config = catalog_toml(sim.url).replace("[server]\n", "[server]\nledger_wait_s = 2\n", 1)
    gw = start_gateway(config, args=("--data-dir", str(small_disk)))
    try:
        t = gw.new_key()
        body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        client = t.http()
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert len(t.usage()) == 1  # committed (reads commit what is journaled): the disk fills after it
        filler = small_disk / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # until ENOSPC
        answers: list[tuple[int, float, str, str | None]] = []  # status, waited, body, generation id
        for _ in range(400):  # SQLite reuses its WAL's pages until the WAL must grow
            started = time.monotonic()
            r = client.post("/v1/chat/completions", json=body)
            answers.append((r.status_code, time.monotonic() - started, r.text,
                            r.headers.get("x-neocloud-generation-id")))
            if r.status_code == 503:
                break
        # Journal and database on the full disk: the first 503 waited for its commit (its event
        # stays queued, so it has a generation id).
        status, waited, text, failed_id = answers[-1]
        assert failed_id is not None, answers[-3:]
        assert status == 503 and "ledger" in text, answers[-3:]
        assert waited < 6, "the request waited a bounded time, it did not hang"
        health = httpx.get(gw.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        started = time.monotonic()
        refused = client.post("/v1/chat/completions", json=body)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert time.monotonic() - started < 1, "new requests are refused at once while the ledger cannot write"
        served = sum(1 for s, _, _, _ in answers if s == 200) + 1
        filler.unlink()
        wait_for(lambda: httpx.get(gw.url + "/health", timeout=5).status_code == 200, timeout=15,
                 what="the ledger writing again")
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        # Every event is there once: those served, the one that got a 503 after its wait, the last one.
        assert len(t.usage()) == served + 2
        org = t.org()
        assert int(org["usage_events"]) == served + 2
        client.close()
    finally:
        stop(gw.proc)

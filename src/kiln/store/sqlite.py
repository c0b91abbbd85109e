"""SQLite storage: the embedded default.

One connection, used by one worker thread, so the event loop does not wait
for the disk. WAL journal; `synchronous` is NORMAL by default (a commit survives
a crash of the process) and FULL on request (it also survives power loss).
The ledger writer batches events, so either way there is one commit per
batch, not per request.

One exception: a small batch of usage events under NORMAL, while the thread
has nothing to do, commits on the event loop. Such a commit writes a few pages
to the WAL (the OS's page cache: no fsync, about 40 µs); handing it to the
thread and back costs longer than that (one request's response waits for it:
about 0.2 ms of a quiet gateway's latency) and buys nothing when nothing else is
waiting. The one writer to the file is this connection (checkpoints are PASSIVE),
so no lock is waited for.

The store's threads run in the idle scheduling class (Linux): see `_yield_cpu`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from kiln.core.records import ApiKey, Org, Project, UsageEvent
from kiln.running import running_loop
from kiln.store.base import (
    Balances,
    CreditBalances,
    OnChange,
    KEY_COLUMNS,
    KEY_UPDATABLE,
    ORG_COLUMNS,
    ORG_UPDATABLE,
    USAGE_COLUMN_COUNT,
    USAGE_COLUMNS,
    Snapshot,
    UsageQuery,
    check_updatable,
    cost_by_owner,
    summary_rows,
    usage_event,
    event_json,
    usage_rows,
    usage_summary_sql,
)
from kiln.store.schema import LEGACY_ORDER, migrations, pending

T = TypeVar("T")

MIGRATIONS = migrations("sqlite")
log = logging.getLogger("kiln.store")
_INSERT_USAGE = (f"INSERT INTO usage_events ({USAGE_COLUMNS}) VALUES ({','.join('?' * USAGE_COLUMN_COUNT)})"
                 " ON CONFLICT (id) DO NOTHING")


def _yield_cpu() -> None:
    """Put the calling thread in the idle scheduling class (Linux; elsewhere, or if refused, nothing).

    A batch of journaled events commits in the store's thread: about 2 ms of CPU for the 180
    events a quiet gateway journals in a tenth of a second. The gateway is one event loop, and
    that thread shares the loop's core with it. At the same priority a request that came during
    a commit waited for it (wrk at one connection: the slow 1% came every 102 ms, with the
    commits). At nice 10 it still waited, for less: the kernel's scheduler (EEVDF) lets the
    running thread finish its time slice before a woken one runs, a stall of 1.5 to 4.5 ms at
    every commit. An idle-class thread gives the core up the moment the loop wakes, and runs
    whenever the loop waits; under full load the ledger's backlog bound makes requests wait for
    their commits, which gives it that time (measured at c=64: the same throughput and flat RSS
    as at nice 10). Linux sets the class per thread (sched_setscheduler with the thread's id)."""
    if sys.platform.startswith("linux"):
        try:
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # a sandbox may refuse it: the thread keeps its priority
            pass


class SQLiteStore:
    shared = False  # one gateway process owns the file
    CHECKPOINT_EVERY_S = 1.0
    # A batch this small that requests wait for commits on the event loop (NORMAL, thread idle):
    # handing a commit to the thread costs about 110 µs of CPU more (the hop and the lock passed
    # back and forth around every statement), more than a 30-event commit itself; 64 events block
    # the loop < 0.5 ms. A journaled batch (no one waits) goes to the thread: the loop serves
    # requests meanwhile, and the linger makes such batches large and rare.
    INLINE_MAX_EVENTS = 64

    def __init__(self, path: str | Path, synchronous: str = "NORMAL") -> None:
        self.path = str(path)
        self.synchronous = synchronous.upper()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-sqlite", initializer=_yield_cpu)
        self._db: sqlite3.Connection | None = None
        self._checkpointer: asyncio.Task[None] | None = None
        self._applied: list[str] = []
        self._jobs = 0  # calls handed to the thread and not yet back

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        loop = running_loop()
        self._jobs += 1
        try:
            return await loop.run_in_executor(self._pool, self._call, fn)
        finally:
            self._jobs -= 1

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        assert self._db is not None, "store is not open"
        return fn(self._db)

    async def open(self) -> None:
        def connect() -> sqlite3.Connection:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))  # SQLite gives -wal and -shm
                os.chmod(self.path, 0o600)  # the database's mode; a file from an older Kiln is tightened
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA synchronous={self.synchronous}")
            db.execute("PRAGMA foreign_keys=ON")
            db.execute("PRAGMA busy_timeout=5000")
            # Checkpoints (the only fsyncs in NORMAL mode) run on their own timer,
            # not inside whichever commit crosses the threshold: no latency spike.
            db.execute("PRAGMA wal_autocheckpoint=0")
            self._applied = _migrate(db)
            return db

        loop = asyncio.get_running_loop()
        self._db = await loop.run_in_executor(self._pool, connect)
        if self.path != ":memory:":
            self._checkpointer = asyncio.create_task(self._checkpoint_loop(), name="kiln-sqlite-checkpoint")

    async def _checkpoint_loop(self) -> None:
        """PASSIVE checkpoints from a second connection: they never block the writer."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-sqlite-checkpoint", initializer=_yield_cpu)
        loop = asyncio.get_running_loop()
        db = await loop.run_in_executor(
            pool, lambda: sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        )
        try:
            while True:
                await asyncio.sleep(self.CHECKPOINT_EVERY_S)
                try:
                    await loop.run_in_executor(pool, lambda: db.execute("PRAGMA wal_checkpoint(PASSIVE)"))
                except sqlite3.Error as exc:  # e.g. the disk is full: try again on the next round
                    log.warning("SQLite checkpoint failed: %s", exc)
        finally:
            pool.submit(db.close)
            pool.shutdown(wait=False)

    async def migrate(self) -> list[str]:
        """SQLite migrates when it opens: what that applied."""
        if self._db is None:
            await self.open()
        return self._applied

    def is_unavailable(self, exc: BaseException) -> bool:
        """Anything but refused data (disk full, I/O error, locked, read-only): retried."""
        return not isinstance(exc, (sqlite3.IntegrityError, sqlite3.DataError, sqlite3.InterfaceError,
                                    ValueError, TypeError, OverflowError))

    async def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.cancel()
            await asyncio.gather(self._checkpointer, return_exceptions=True)
        if self._db is not None:
            await self._run(lambda db: db.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
            await self._run(lambda db: db.close())
            self._db = None
        self._pool.shutdown(wait=True)

    async def load(self, month_start: float | None) -> Snapshot:
        def load(db: sqlite3.Connection) -> Snapshot:
            spend = {} if month_start is None else dict(
                db.execute(
                    "SELECT org_id, SUM(cost_nano) FROM usage_events WHERE created_at >= ? GROUP BY org_id",
                    (month_start,),
                ).fetchall()
            )
            orgs = []
            for row in db.execute(f"SELECT {ORG_COLUMNS} FROM orgs"):
                org = Org(*row)
                org.month_spend_nano = spend.get(org.id) or 0
                orgs.append(org)
            projects = [Project(*r) for r in db.execute("SELECT id, org_id, name, created_at FROM projects")]
            keys = [ApiKey(*r) for r in db.execute(f"SELECT {KEY_COLUMNS} FROM api_keys")]
            return Snapshot(orgs, projects, keys)

        return await self._run(load)

    async def insert_org(self, org: Org) -> None:
        await self._write(
            f"INSERT INTO orgs ({ORG_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
            (org.id, org.name, org.credits_nano, org.monthly_budget_nano, org.rpm_limit,
             org.tpm_limit, org.concurrency_limit, org.created_at),
        )

    async def update_org(self, org_id: str, fields: dict[str, Any]) -> None:
        await self._update("orgs", ORG_UPDATABLE, org_id, fields)

    async def add_credits(self, org_id: str, amount_nano: int, note: str) -> tuple[int, int]:
        def add(db: sqlite3.Connection) -> tuple[int, int]:
            with _tx(db):
                db.execute(
                    "INSERT INTO credit_grants (org_id, amount_nano, note, created_at) VALUES (?,?,?,?)",
                    (org_id, amount_nano, note, time.time()),
                )
                db.execute("UPDATE orgs SET credits_nano = credits_nano + ?, credits_version = credits_version + 1"
                           " WHERE id = ?", (amount_nano, org_id))
                return db.execute("SELECT credits_nano, credits_version FROM orgs WHERE id = ?", (org_id,)).fetchone()

        return await self._run(add)

    async def insert_project(self, project: Project) -> None:
        await self._write(
            "INSERT INTO projects (id, org_id, name, created_at) VALUES (?,?,?,?)",
            (project.id, project.org_id, project.name, project.created_at),
        )

    async def insert_key(self, key: ApiKey) -> None:
        await self._write(
            f"INSERT INTO api_keys ({KEY_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (key.id, key.project_id, key.org_id, key.key_hash, key.prefix, key.name, key.status,
             key.spend_limit_nano, key.expires_at, key.spend_nano, key.created_at, key.spend_reset,
             key.rpm_limit, key.tpm_limit, key.concurrency_limit),
        )

    async def update_key(self, key_id: str, fields: dict[str, Any]) -> None:
        await self._update("api_keys", KEY_UPDATABLE, key_id, fields)

    async def record_usage(self, events: list[UsageEvent], *, waited: bool = True) -> CreditBalances:
        rows = usage_rows(events)

        def record(db: sqlite3.Connection) -> CreditBalances:
            with _tx(db):
                # Row by row: an event already there (a retried batch) is skipped and bills nothing.
                inserted = [e for e, row in zip(events, rows) if db.execute(_INSERT_USAGE, row).rowcount == 1]
                org_cost, key_cost = cost_by_owner(inserted)
                db.executemany(
                    "UPDATE orgs SET credits_nano = credits_nano - ?, credits_version = credits_version + 1"
                    " WHERE id = ?", org_cost,
                )
                db.executemany("UPDATE api_keys SET spend_nano = spend_nano + ? WHERE id = ?", key_cost)
                return {org_id: tuple(db.execute(  # type: ignore[misc]
                    "SELECT credits_nano, credits_version FROM orgs WHERE id = ?", (org_id,)).fetchone())
                    for _, org_id in org_cost}

        if waited and self._jobs == 0 and len(events) <= self.INLINE_MAX_EVENTS and self.synchronous == "NORMAL":
            return self._call(record)  # the thread is idle: nothing can use the connection meanwhile
        return await self._run(record)

    async def dead_letter(self, event: UsageEvent, error: str) -> None:
        await self._write(
            "INSERT INTO usage_dead_letters (event_id, created_at, event, error) VALUES (?, ?, ?, ?)",
            (event.id, time.time(), event_json(event).decode(), error),
        )

    async def balances(self, org_id: str, key_id: str, month_start: float, key_since: float | None) -> Balances:
        def query(db: sqlite3.Connection) -> Balances:
            credits = db.execute("SELECT credits_nano, credits_version FROM orgs WHERE id = ?", (org_id,)).fetchone()
            if credits is None:
                raise LookupError(f"no organisation {org_id}")
            month = db.execute("SELECT COALESCE(SUM(cost_nano), 0) FROM usage_events WHERE org_id = ?"
                               " AND created_at >= ?", (org_id, month_start)).fetchone()[0]
            if key_since is None:
                key = db.execute("SELECT spend_nano FROM api_keys WHERE id = ?", (key_id,)).fetchone()
            else:
                key = db.execute("SELECT COALESCE(SUM(cost_nano), 0) FROM usage_events WHERE key_id = ?"
                                 " AND created_at >= ?", (key_id, key_since)).fetchone()
            return Balances(credits[0], credits[1], month, key[0] if key else 0)

        return await self._run(query)

    async def credit_balances(self) -> CreditBalances:
        def query(db: sqlite3.Connection) -> CreditBalances:
            return {r[0]: (r[1], r[2]) for r in db.execute("SELECT id, credits_nano, credits_version FROM orgs")}

        return await self._run(query)

    async def listen(self, on_change: OnChange) -> None:
        """One process owns the file: nobody else changes it."""

    async def key_spend_since(self, since: float) -> dict[str, int]:
        def query(db: sqlite3.Connection) -> dict[str, int]:
            rows = db.execute(
                "SELECT key_id, SUM(cost_nano) FROM usage_events WHERE created_at >= ? GROUP BY key_id", (since,)
            )
            return {k: int(v) for k, v in rows}

        return await self._run(query)

    async def list_usage(
        self, org_id: str | None = None, key_id: str | None = None, limit: int = 100
    ) -> list[UsageEvent]:
        where, args = [], []
        if org_id:
            where.append("org_id = ?")
            args.append(org_id)
        if key_id:
            where.append("key_id = ?")
            args.append(key_id)
        sql = f"SELECT {USAGE_COLUMNS} FROM usage_events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        args.append(limit)

        def query(db: sqlite3.Connection) -> list[UsageEvent]:
            return [usage_event(r) for r in db.execute(sql, args)]

        return await self._run(query)

    async def get_usage(self, event_id: str) -> UsageEvent | None:
        def query(db: sqlite3.Connection) -> UsageEvent | None:
            row = db.execute(f"SELECT {USAGE_COLUMNS} FROM usage_events WHERE id = ?", (event_id,)).fetchone()
            return None if row is None else usage_event(row)

        return await self._run(query)

    async def usage_summary(self, query: UsageQuery) -> list[dict[str, Any]]:
        sql, args = usage_summary_sql(query, "strftime('%Y-%m-%d', created_at, 'unixepoch')", lambda _: "?")
        return summary_rows(query, await self._run(lambda db: db.execute(sql, args).fetchall()))

    async def usage_totals(self, org_id: str) -> dict[str, int]:
        def query(db: sqlite3.Connection) -> dict[str, int]:
            n, cost = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(cost_nano), 0) FROM usage_events WHERE org_id = ?", (org_id,)
            ).fetchone()
            granted = db.execute(
                "SELECT COALESCE(SUM(amount_nano), 0) FROM credit_grants WHERE org_id = ?", (org_id,)
            ).fetchone()[0]
            return {"events": n, "cost_nano": cost, "granted_nano": granted}

        return await self._run(query)

    async def get_meta(self, name: str) -> str | None:
        def get(db: sqlite3.Connection) -> str | None:
            row = db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
            return row[0] if row else None

        return await self._run(get)

    async def set_meta(self, name: str, value: str) -> None:
        await self._write(
            "INSERT INTO meta (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = excluded.value",
            (name, value),
        )

    async def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        def write(db: sqlite3.Connection) -> None:
            with _tx(db):
                db.execute(sql, args)

        await self._run(write)

    async def _update(self, table: str, allowed: set[str], row_id: str, fields: dict[str, Any]) -> None:
        check_updatable(table, allowed, fields)
        if not fields:
            return
        cols = ", ".join(f"{name} = ?" for name in fields)
        await self._write(f"UPDATE {table} SET {cols} WHERE id = ?", (*fields.values(), row_id))


class _tx:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if not exc_type:
            self.db.execute("COMMIT")
        elif self.db.in_transaction:  # SQLite may have rolled back already (e.g. disk full)
            self.db.execute("ROLLBACK")


def _migrate(db: sqlite3.Connection) -> list[str]:
    """Apply the pending migrations, each in its own transaction with its record; a file
    from before named migrations (PRAGMA user_version) is converted first."""
    db.execute("CREATE TABLE IF NOT EXISTS kiln_migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    applied = {r[0] for r in db.execute("SELECT name FROM kiln_migrations")}
    legacy = db.execute("PRAGMA user_version").fetchone()[0]  # left as it is: older versions still read it
    if legacy and not applied:
        applied = set(LEGACY_ORDER[:legacy])
        db.executemany("INSERT INTO kiln_migrations VALUES (?, ?)", [(name, time.time()) for name in applied])
    todo = pending(MIGRATIONS, applied)
    for migration in todo:
        db.executescript(f"BEGIN; {migration.sql}; INSERT INTO kiln_migrations VALUES "
                         f"('{migration.name}', {time.time()}); COMMIT;")
        log.info("applied migration %s", migration.name)
    return [m.name for m in todo]

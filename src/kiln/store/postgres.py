"""PostgreSQL storage: the same interface as SQLite, for several replicas.

asyncpg with a bounded pool (`pool_size` connections per process, every query
under a deadline, so a dead server fails fast instead of hanging). Amounts are
BIGINT nanodollars. A usage batch is one transaction: insert the events not
there yet, deduct their credits, add their key spend — so the ledger and the
balances can never disagree and a retried batch bills nothing twice. Every
change of keys, organisations, credits or settings sends a NOTIFY in its own
transaction, which `listen` turns into a refresh on every replica. `schema`
isolates tenants of one database (tests use a schema each).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import asyncpg

from kiln.core.records import ApiKey, Org, Project, UsageEvent
from kiln.store.base import (
    Balances,
    CreditBalances,
    OnChange,
    OutdatedSchema,
    KEY_COLUMNS,
    KEY_UPDATABLE,
    ORG_COLUMNS,
    ORG_UPDATABLE,
    USAGE_COLUMNS,
    Snapshot,
    UsageQuery,
    check_updatable,
    summary_rows,
    usage_event,
    event_json,
    usage_rows,
    usage_summary_sql,
)
from kiln.store.schema import LEGACY_ORDER, Migration, migrations, pending

MIGRATIONS = migrations("postgres")
log = logging.getLogger("kiln.store")

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# Data the server (or asyncpg, encoding it) refused: the only failures that set an event aside.
# Anything else (connections, shutdowns, a full disk, client state) is the store's, retried.
_REFUSED_DATA = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError, ValueError, TypeError, OverflowError)
_USAGE_TYPES = ("text", "float8", "text", "text", "text", "text", "text", "int8", "int8", "int8", "int8", "int8",
                "text", "bool", "float8", "float8", "bool", "text", "text")
# One statement, so one round trip and one implicit transaction: insert the events not there yet,
# then move the balances by what was inserted (organisations locked in id order: no deadlocks).
_RECORD_USAGE = (
    f"WITH ins AS (INSERT INTO usage_events ({USAGE_COLUMNS}) SELECT * FROM unnest("
    + ", ".join(f"${i}::{t}[]" for i, t in enumerate(_USAGE_TYPES, start=1))
    + ") ON CONFLICT (id) DO NOTHING RETURNING org_id, key_id, cost_nano),"
    " org_cost AS (SELECT org_id, SUM(cost_nano) AS cost FROM ins GROUP BY org_id HAVING SUM(cost_nano) <> 0),"
    " key_cost AS (SELECT key_id, SUM(cost_nano) AS cost FROM ins GROUP BY key_id HAVING SUM(cost_nano) <> 0),"
    " locked AS MATERIALIZED (SELECT id FROM orgs WHERE id IN (SELECT org_id FROM org_cost) ORDER BY id FOR UPDATE),"
    " moved AS (UPDATE orgs SET credits_nano = orgs.credits_nano - org_cost.cost,"
    " credits_version = orgs.credits_version + 1 FROM org_cost, locked"
    " WHERE orgs.id = org_cost.org_id AND locked.id = orgs.id RETURNING orgs.id, orgs.credits_nano, orgs.credits_version),"
    " spent AS (UPDATE api_keys SET spend_nano = api_keys.spend_nano + key_cost.cost FROM key_cost"
    " WHERE api_keys.id = key_cost.key_id RETURNING 1)"
    " SELECT id, credits_nano, credits_version FROM moved"
)


class PostgresStore:
    shared = True  # several gateways may use one database: they refresh their caches from it
    QUERY_TIMEOUT_S = 10.0

    def __init__(self, dsn: str, schema: str = "public", pool_size: int = 4) -> None:
        if not _SCHEMA_NAME.match(schema):
            raise ValueError(f"invalid schema name {schema!r}")
        self.dsn = dsn
        self.schema = schema
        self.pool_size = pool_size
        self.channel = f"kiln_{schema}"[:63]
        self.pool: asyncpg.Pool | None = None
        self._lock_conn: asyncpg.Connection | None = None

    async def open(self) -> None:
        """Connect; an empty schema is created and migrated, a behind one is refused."""
        await self._migrate(only_if_empty=True)
        # A server setting, not SET: the pool's RESET ALL on release would undo a SET.
        self.pool = await asyncpg.create_pool(
            self.dsn, min_size=1, max_size=self.pool_size, timeout=5, command_timeout=self.QUERY_TIMEOUT_S,
            server_settings={"search_path": self.schema},
        )

    async def migrate(self) -> list[str]:
        return await self._migrate(only_if_empty=False)

    async def _migrate(self, only_if_empty: bool) -> list[str]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self.schema}")
            await conn.execute(f"SET search_path TO {self.schema}")
            async with conn.transaction():
                # One migrator at a time per schema: replicas may start together.
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"kiln-migrate:{self.schema}")
                applied = await _applied(conn)
                todo = pending(MIGRATIONS, applied or set())
                if todo and applied is not None and only_if_empty:
                    raise OutdatedSchema(
                        f"schema {self.schema!r} lacks migrations {', '.join(m.name for m in todo)}:"
                        " run `kiln migrate` (see docs/deploy.md, upgrades)")
                for migration in todo:
                    await _apply(conn, migration)
                return [m.name for m in todo]
        finally:
            await conn.close()

    def is_unavailable(self, exc: BaseException) -> bool:
        # asyncpg's client-side DataError (a value it cannot encode) is a ValueError.
        return not isinstance(exc, _REFUSED_DATA)

    async def hold_sole_admission(self) -> None:
        """Take this schema's in-process-admission lock for as long as the store is open, or raise:
        two gateways admitting on their own views of one database's balances would together
        exceed every limit. (A session lock: it goes with this connection.)"""
        self._lock_conn = await asyncpg.connect(self.dsn, timeout=10)
        if not await self._lock_conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1))",
                                              f"kiln-memory-admission:{self.schema}"):
            await self._lock_conn.close()
            self._lock_conn = None
            raise RuntimeError(
                f"another gateway already uses schema {self.schema!r} with in-process admission; several"
                " gateways on one database need shared admission: set server.redis_url (or KILN_REDIS_URL)")

    async def close(self) -> None:
        if self._lock_conn is not None:
            await self._lock_conn.close()
            self._lock_conn = None
        if self.pool is not None:
            await self.pool.close()
            self.pool = None

    @property
    def _pool(self) -> asyncpg.Pool:
        assert self.pool is not None, "store is not open"
        return self.pool

    async def load(self, month_start: float | None) -> Snapshot:
        async with self._pool.acquire() as conn:
            spend = {} if month_start is None else {
                r[0]: r[1]
                for r in await conn.fetch(
                    "SELECT org_id, SUM(cost_nano) FROM usage_events WHERE created_at >= $1 GROUP BY org_id",
                    month_start,
                )
            }
            orgs = []
            for row in await conn.fetch(f"SELECT {ORG_COLUMNS} FROM orgs"):
                org = Org(*row)
                org.month_spend_nano = int(spend.get(org.id) or 0)
                orgs.append(org)
            projects = [Project(*r) for r in await conn.fetch("SELECT id, org_id, name, created_at FROM projects")]
            keys = [ApiKey(*r) for r in await conn.fetch(f"SELECT {KEY_COLUMNS} FROM api_keys")]
        return Snapshot(orgs, projects, keys)

    async def insert_org(self, org: Org) -> None:
        await self._write(
            "accounts", f"INSERT INTO orgs ({ORG_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8)",
            org.id, org.name, org.credits_nano, org.monthly_budget_nano, org.rpm_limit,
            org.tpm_limit, org.concurrency_limit, org.created_at,
        )

    async def update_org(self, org_id: str, fields: dict[str, Any]) -> None:
        await self._update("orgs", ORG_UPDATABLE, org_id, fields)

    async def add_credits(self, org_id: str, amount_nano: int, note: str) -> tuple[int, int]:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO credit_grants (org_id, amount_nano, note, created_at) VALUES ($1,$2,$3,$4)",
                org_id, amount_nano, note, time.time(),
            )
            row = await conn.fetchrow(
                "UPDATE orgs SET credits_nano = credits_nano + $1, credits_version = credits_version + 1"
                " WHERE id = $2 RETURNING credits_nano, credits_version",
                amount_nano, org_id,
            )
            await self._notify(conn, "credits")
        return int(row[0]), int(row[1])

    async def insert_project(self, project: Project) -> None:
        await self._write(
            "accounts", "INSERT INTO projects (id, org_id, name, created_at) VALUES ($1,$2,$3,$4)",
            project.id, project.org_id, project.name, project.created_at,
        )

    async def insert_key(self, key: ApiKey) -> None:
        await self._write(
            "accounts", f"INSERT INTO api_keys ({KEY_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15)",
            key.id, key.project_id, key.org_id, key.key_hash, key.prefix, key.name, key.status,
            key.spend_limit_nano, key.expires_at, key.spend_nano, key.created_at, key.spend_reset,
            key.rpm_limit, key.tpm_limit, key.concurrency_limit,
        )

    async def update_key(self, key_id: str, fields: dict[str, Any]) -> None:
        await self._update("api_keys", KEY_UPDATABLE, key_id, fields)

    async def record_usage(self, events: list[UsageEvent], *, waited: bool = True) -> CreditBalances:
        rows = await self._pool.fetch(_RECORD_USAGE, *zip(*usage_rows(events)))
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    async def dead_letter(self, event: UsageEvent, error: str) -> None:
        await self._pool.execute(
            "INSERT INTO usage_dead_letters (event_id, created_at, event, error) VALUES ($1, $2, $3, $4)",
            event.id, time.time(), event_json(event).decode(), error,
        )

    async def balances(self, org_id: str, key_id: str, month_start: float, key_since: float | None) -> Balances:
        async with self._pool.acquire() as conn:
            credits = await conn.fetchrow("SELECT credits_nano, credits_version FROM orgs WHERE id = $1", org_id)
            month = await conn.fetchval(
                "SELECT COALESCE(SUM(cost_nano), 0) FROM usage_events WHERE org_id = $1 AND created_at >= $2",
                org_id, month_start,
            )
            if key_since is None:
                key = await conn.fetchval("SELECT spend_nano FROM api_keys WHERE id = $1", key_id)
            else:
                key = await conn.fetchval(
                    "SELECT COALESCE(SUM(cost_nano), 0) FROM usage_events WHERE key_id = $1 AND created_at >= $2",
                    key_id, key_since,
                )
        if credits is None:
            raise LookupError(f"no organisation {org_id}")
        return Balances(int(credits[0]), int(credits[1]), int(month), int(key or 0))

    async def credit_balances(self) -> CreditBalances:
        rows = await self._pool.fetch("SELECT id, credits_nano, credits_version FROM orgs")
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    async def listen(self, on_change: OnChange) -> None:
        """A connection of its own on the change channel, reconnected with backoff; after each
        (re)connection `on_change("*")`, for what was missed while it was down."""
        delay = 0.5
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await asyncpg.connect(self.dsn, timeout=5)
                await conn.add_listener(self.channel, lambda _c, _pid, _ch, payload: on_change(payload))
                on_change("*")
                delay = 0.5
                while True:  # a dead server or a lost route shows up here, not only as a closed socket
                    await asyncio.sleep(2.0)
                    await asyncio.wait_for(conn.fetchval("SELECT 1"), 5.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("change listener on PostgreSQL lost (%s); reconnecting in %.1fs", type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            finally:
                if conn is not None:
                    conn.terminate()

    async def _notify(self, conn: asyncpg.Connection, what: str) -> None:
        await conn.execute("SELECT pg_notify($1, $2)", self.channel, what)

    async def key_spend_since(self, since: float) -> dict[str, int]:
        rows = await self._pool.fetch(
            "SELECT key_id, SUM(cost_nano) FROM usage_events WHERE created_at >= $1 GROUP BY key_id", since
        )
        return {r[0]: int(r[1]) for r in rows}

    async def list_usage(
        self, org_id: str | None = None, key_id: str | None = None, limit: int = 100
    ) -> list[UsageEvent]:
        where, args = [], []
        for column, value in (("org_id", org_id), ("key_id", key_id)):
            if value:
                args.append(value)
                where.append(f"{column} = ${len(args)}")
        sql = f"SELECT {USAGE_COLUMNS} FROM usage_events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        args.append(limit)
        sql += f" ORDER BY created_at DESC, seq DESC LIMIT ${len(args)}"
        return [usage_event(r) for r in await self._pool.fetch(sql, *args)]

    async def get_usage(self, event_id: str) -> UsageEvent | None:
        row = await self._pool.fetchrow(f"SELECT {USAGE_COLUMNS} FROM usage_events WHERE id = $1", event_id)
        return None if row is None else usage_event(row)

    async def usage_summary(self, query: UsageQuery) -> list[dict[str, Any]]:
        day = "to_char(to_timestamp(created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
        sql, args = usage_summary_sql(query, day, lambda n: f"${n}")
        return summary_rows(query, await self._pool.fetch(sql, *args))

    async def usage_totals(self, org_id: str) -> dict[str, int]:
        async with self._pool.acquire() as conn:
            n, cost = await conn.fetchrow(
                "SELECT COUNT(*), COALESCE(SUM(cost_nano), 0) FROM usage_events WHERE org_id = $1", org_id
            )
            granted = await conn.fetchval(
                "SELECT COALESCE(SUM(amount_nano), 0) FROM credit_grants WHERE org_id = $1", org_id
            )
        return {"events": int(n), "cost_nano": int(cost), "granted_nano": int(granted)}

    async def get_meta(self, name: str) -> str | None:
        return await self._pool.fetchval("SELECT value FROM meta WHERE name = $1", name)

    async def set_meta(self, name: str, value: str) -> None:
        await self._write(
            name, "INSERT INTO meta (name, value) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            name, value,
        )

    async def _write(self, what: str, sql: str, *args: Any) -> None:
        """One statement and its change notice, in one transaction."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(sql, *args)
            await self._notify(conn, what)

    async def _update(self, table: str, allowed: set[str], row_id: str, fields: dict[str, Any]) -> None:
        check_updatable(table, allowed, fields)
        if not fields:
            return
        cols = ", ".join(f"{name} = ${i}" for i, name in enumerate(fields, start=1))
        await self._write("accounts", f"UPDATE {table} SET {cols} WHERE id = ${len(fields) + 1}",
                          *fields.values(), row_id)


async def _applied(conn: asyncpg.Connection) -> set[str] | None:
    """Names of the migrations applied; None for an empty schema. A database from before
    named migrations (kiln_schema_version) is converted."""
    tables = {r[0] for r in await conn.fetch(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")}
    if "kiln_migrations" not in tables:
        await conn.execute("CREATE TABLE kiln_migrations (name TEXT PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)")
        legacy = await conn.fetchval("SELECT version FROM kiln_schema_version") if "kiln_schema_version" in tables else 0
        for name in LEGACY_ORDER[:legacy or 0]:
            await conn.execute("INSERT INTO kiln_migrations VALUES ($1, $2)", name, time.time())
        if "orgs" not in tables:
            return None
    return {r[0] for r in await conn.fetch("SELECT name FROM kiln_migrations")}


async def _apply(conn: asyncpg.Connection, migration: Migration) -> None:
    await conn.execute(migration.sql)
    await conn.execute("INSERT INTO kiln_migrations VALUES ($1, $2)", migration.name, time.time())
    log.info("applied migration %s", migration.name)

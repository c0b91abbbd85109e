"""PostgreSQL storage: the same interface as SQLite, for several replicas.

asyncpg with a small pool. Amounts are BIGINT nanodollars. A usage batch is
one transaction: insert the events, deduct the credits, add the key spend —
so the ledger and the balances can never disagree. `schema` isolates
tenants of one database (tests use a schema each).
"""

from __future__ import annotations

import re
import time
from typing import Any

import asyncpg

from kiln.core.records import ApiKey, Org, Project, UsageEvent
from kiln.store.base import (
    KEY_COLUMNS,
    KEY_UPDATABLE,
    ORG_COLUMNS,
    ORG_UPDATABLE,
    USAGE_COLUMNS,
    Snapshot,
    UsageQuery,
    check_updatable,
    cost_by_owner,
    summary_rows,
    usage_event,
    usage_rows,
    usage_summary_sql,
)
from kiln.store.schema import migrations

MIGRATIONS = migrations("postgres")

_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresStore:
    shared = True  # several gateways may use one database: they refresh their caches from it
    def __init__(self, dsn: str, schema: str = "public") -> None:
        if not _SCHEMA_NAME.match(schema):
            raise ValueError(f"invalid schema name {schema!r}")
        self.dsn = dsn
        self.schema = schema
        self.pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        conn = await asyncpg.connect(self.dsn)
        try:
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {self.schema}")
            await conn.execute(f"SET search_path TO {self.schema}")
            await _migrate(conn)
        finally:
            await conn.close()
        # A server setting, not SET: the pool's RESET ALL on release would undo a SET.
        self.pool = await asyncpg.create_pool(
            self.dsn, min_size=1, max_size=4, server_settings={"search_path": self.schema}
        )

    async def close(self) -> None:
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
        await self._pool.execute(
            f"INSERT INTO orgs ({ORG_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8)",
            org.id, org.name, org.credits_nano, org.monthly_budget_nano, org.rpm_limit,
            org.tpm_limit, org.concurrency_limit, org.created_at,
        )

    async def update_org(self, org_id: str, fields: dict[str, Any]) -> None:
        await self._update("orgs", ORG_UPDATABLE, org_id, fields)

    async def add_credits(self, org_id: str, amount_nano: int, note: str) -> int:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO credit_grants (org_id, amount_nano, note, created_at) VALUES ($1,$2,$3,$4)",
                org_id, amount_nano, note, time.time(),
            )
            return int(await conn.fetchval(
                "UPDATE orgs SET credits_nano = credits_nano + $1 WHERE id = $2 RETURNING credits_nano",
                amount_nano, org_id,
            ))

    async def insert_project(self, project: Project) -> None:
        await self._pool.execute(
            "INSERT INTO projects (id, org_id, name, created_at) VALUES ($1,$2,$3,$4)",
            project.id, project.org_id, project.name, project.created_at,
        )

    async def insert_key(self, key: ApiKey) -> None:
        await self._pool.execute(
            f"INSERT INTO api_keys ({KEY_COLUMNS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15)",
            key.id, key.project_id, key.org_id, key.key_hash, key.prefix, key.name, key.status,
            key.spend_limit_nano, key.expires_at, key.spend_nano, key.created_at, key.spend_reset,
            key.rpm_limit, key.tpm_limit, key.concurrency_limit,
        )

    async def update_key(self, key_id: str, fields: dict[str, Any]) -> None:
        await self._update("api_keys", KEY_UPDATABLE, key_id, fields)

    async def record_usage(self, events: list[UsageEvent]) -> None:
        rows = usage_rows(events)
        org_cost, key_cost = cost_by_owner(events)

        async with self._pool.acquire() as conn, conn.transaction():
            await conn.copy_records_to_table(
                "usage_events", records=rows, columns=[c.strip() for c in USAGE_COLUMNS.split(",")],
                schema_name=self.schema,
            )
            if org_cost:
                await conn.executemany(
                    "UPDATE orgs SET credits_nano = credits_nano - $1 WHERE id = $2",
                    org_cost,
                )
            if key_cost:
                await conn.executemany(
                    "UPDATE api_keys SET spend_nano = spend_nano + $1 WHERE id = $2",
                    key_cost,
                )

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
        await self._pool.execute(
            "INSERT INTO meta (name, value) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET value = excluded.value",
            name, value,
        )

    async def _update(self, table: str, allowed: set[str], row_id: str, fields: dict[str, Any]) -> None:
        check_updatable(table, allowed, fields)
        if not fields:
            return
        cols = ", ".join(f"{name} = ${i}" for i, name in enumerate(fields, start=1))
        await self._pool.execute(
            f"UPDATE {table} SET {cols} WHERE id = ${len(fields) + 1}", *fields.values(), row_id
        )


async def _migrate(conn: asyncpg.Connection) -> None:
    await conn.execute("CREATE TABLE IF NOT EXISTS kiln_schema_version (version INTEGER NOT NULL)")
    async with conn.transaction():
        await conn.execute("LOCK TABLE kiln_schema_version IN EXCLUSIVE MODE")  # replicas starting together
        version = await conn.fetchval("SELECT version FROM kiln_schema_version")
        if version is None:
            await conn.execute("INSERT INTO kiln_schema_version VALUES (0)")
            version = 0
        for number, sql in enumerate(MIGRATIONS[version:], start=version + 1):
            await conn.execute(sql)
            await conn.execute("UPDATE kiln_schema_version SET version = $1", number)

"""Named schema migrations: a database from an older version is brought up to date, never twice.

SQLite migrates when the gateway opens it. PostgreSQL, shared by replicas of
mixed versions during a rolling upgrade, migrates an empty schema by itself
and otherwise refuses to start until `kiln migrate` ran (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import asyncpg
import pytest

from conftest import PG_DSN as DSN, drop_pg_schema
from kiln.store.base import OutdatedSchema
from kiln.store.postgres import PostgresStore
from kiln.store.schema import LEGACY_ORDER, migrations
from kiln.store.sqlite import SQLiteStore

NAMES = [m.name for m in migrations("sqlite")]


def test_sqlite_file_from_before_named_migrations_is_brought_up_to_date(tmp_path: Path) -> None:
    path = tmp_path / "kiln.db"
    with sqlite3.connect(path) as db:  # what the previous version left: positions, in user_version
        for migration in migrations("sqlite")[:len(LEGACY_ORDER)]:
            db.executescript(migration.sql)
        db.execute(f"PRAGMA user_version = {len(LEGACY_ORDER)}")
        db.execute("INSERT INTO orgs (id, name, credits_nano, created_at) VALUES ('org_1', 'old', 5, 0)")

    async def run() -> list[str]:
        store = SQLiteStore(path)
        await store.open()
        try:
            assert (await store.balances("org_1", "key_none", 0.0, 0.0)).credits_nano == 5
            return await store.migrate()
        finally:
            await store.close()

    assert asyncio.run(run()) == NAMES[len(LEGACY_ORDER):]
    with sqlite3.connect(path) as db:
        assert [r[0] for r in db.execute("SELECT name FROM kiln_migrations ORDER BY name")] == sorted(NAMES)
    assert asyncio.run(run()) == [], "nothing applied twice"


@pytest.fixture
def legacy_schema() -> Iterator[str]:
    schema = f"kiln_legacy_{secrets.token_hex(4)}"

    async def make() -> None:
        conn = await asyncpg.connect(DSN)
        try:
            await conn.execute(f"CREATE SCHEMA {schema}; SET search_path TO {schema}")
            for migration in migrations("postgres")[:len(LEGACY_ORDER)]:
                await conn.execute(migration.sql)
            await conn.execute(f"CREATE TABLE kiln_schema_version (version INTEGER NOT NULL);"
                               f" INSERT INTO kiln_schema_version VALUES ({len(LEGACY_ORDER)})")
        finally:
            await conn.close()

    asyncio.run(make())
    yield schema
    drop_pg_schema(schema)


def test_postgres_schema_behind_refuses_to_start_until_kiln_migrate(legacy_schema: str, tmp_path: Path) -> None:
    with pytest.raises(OutdatedSchema, match="kiln migrate"):
        asyncio.run(PostgresStore(DSN, legacy_schema).open())
    env = {**os.environ, "KILN_DATABASE": f"{DSN}?schema={legacy_schema}"}
    cmd = [sys.executable, "-m", "kiln", "migrate"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert ", ".join(NAMES[len(LEGACY_ORDER):]) in done.stdout

    async def opens() -> None:
        store = PostgresStore(DSN, legacy_schema)
        await store.open()
        await store.close()

    asyncio.run(opens())
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert "up to date" in again.stdout

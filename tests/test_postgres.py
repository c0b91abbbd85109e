"""The same gateway on PostgreSQL: ledger, balances and keys survive a restart.

Uses the real server on 127.0.0.1:5432 (database `test`), one schema per run.
"""

from __future__ import annotations

import asyncio
import secrets
from decimal import Decimal
from typing import Any, Iterator

import asyncpg
import pytest

from conftest import PG_DSN as DSN, Gateway, Sim, catalog_toml, drop_pg_schema, start_gateway, stop, wait_for
from kiln.store.postgres import PostgresStore
from kiln.store.schema import migrations
from test_usage import check_summary_across_days


@pytest.fixture
def pg_schema() -> Iterator[str]:
    schema = f"kiln_test_{secrets.token_hex(4)}"
    yield schema
    drop_pg_schema(schema)


def _pg_gateway(sim: Sim, schema: str) -> Gateway:
    return start_gateway(catalog_toml(sim.url), env={"KILN_DATABASE": f"{DSN}?schema={schema}"})


def test_postgres_ledger_and_restart(sim: Sim, pg_schema: str) -> None:
    gw = _pg_gateway(sim, pg_schema)
    try:
        tenant = gw.new_key(credits="3")
        client = tenant.openai()
        costs = []
        for i in range(5):
            raw = client.chat.completions.with_raw_response.create(
                model="qwen3-32b", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=20
            )
            costs.append(Decimal(str(raw.parse().usage.model_extra["cost"])))
        stream = client.chat.completions.create(
            model="qwen3-32b", messages=[{"role": "user", "content": "stream it"}], max_tokens=10,
            stream=True, stream_options={"include_usage": True},
        )
        last = list(stream)[-1]
        costs.append(Decimal(str(last.usage.model_extra["cost"])))
        events = tenant.usage()
        assert len(events) == 6
        assert sum(Decimal(e["cost"]) for e in events) == sum(costs)
        org = tenant.org()
        assert Decimal(org["total_granted"]) - Decimal(org["credits"]) == sum(costs)
        key_before = tenant.http().get("/v1/key").json()
        assert Decimal(key_before["spend"]) == sum(costs)
        tenant.gw.admin.post(f"/keys/{tenant.key_id}/suspend")
    finally:
        stop(gw.proc)

    gw2 = _pg_gateway(sim, pg_schema)
    try:
        # Same database: the key exists, is still suspended, balances are as they were.
        r = gw2.http(tenant.key).post("/v1/chat/completions", json={
            "model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 403
        gw2.admin.post(f"/keys/{tenant.key_id}/reactivate")
        key_after = gw2.http(tenant.key).get("/v1/key").json()
        assert key_after["spend"] == key_before["spend"]
        org2 = gw2.admin.get(f"/orgs/{tenant.org_id}").json()
        assert org2["credits"] == org["credits"]
        assert org2["usage_events"] == 6
    finally:
        stop(gw2.proc)


def test_a_second_gateway_without_shared_admission_is_refused(sim: Sim, pg_schema: str) -> None:
    """Two gateways admitting on their own views of one database would together pass every limit."""
    env = {"KILN_DATABASE": f"{DSN}?schema={pg_schema}"}
    a = start_gateway(catalog_toml(sim.url), env=env)
    try:
        with pytest.raises(RuntimeError, match="redis_url"):
            stop(start_gateway(catalog_toml(sim.url), env=env).proc)
    finally:
        stop(a.proc)


def test_two_gateways_on_one_database_share_keys_and_status(sim: Sim, pg_schema: str) -> None:
    """A key created or suspended through one replica holds on the other within the refresh interval."""
    config = catalog_toml(sim.url).replace("[server]\n", "[server]\nrefresh_s = 0.3\n", 1)
    env = {"KILN_DATABASE": f"{DSN}?schema={pg_schema}", "KILN_REDIS_URL": "redis://127.0.0.1:6379/0",
           "KILN_REDIS_PREFIX": f"kiln-test-{pg_schema}"}
    a = start_gateway(config, env=env)
    b = start_gateway(config, env=env)
    try:
        tenant = a.new_key()
        body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        with b.http(tenant.key) as c:
            wait_for(lambda: c.post("/v1/chat/completions", json=body).status_code == 200, what="key on replica b")
            a.admin.post(f"/keys/{tenant.key_id}/suspend")
            wait_for(lambda: c.post("/v1/chat/completions", json=body).status_code == 403, what="suspension on b")
            a.admin.post(f"/keys/{tenant.key_id}/reactivate")
            wait_for(lambda: c.post("/v1/chat/completions", json=body).status_code == 200, what="reactivation")
        # Both replicas wrote to the one ledger.
        assert len(tenant.usage()) >= 2
    finally:
        stop(a.proc)
        stop(b.proc)


def test_postgres_usage_summary_and_generation_lookup(sim: Sim, pg_schema: str) -> None:
    """The same GROUP BY on PostgreSQL (its own UTC-day expression), and GET /v1/generation."""
    gw = start_gateway(catalog_toml(sim.url), env={"KILN_DATABASE": f"{DSN}?schema={pg_schema}",
                                                   "KILN_TEST_CLOCK": "1"})
    try:
        check_summary_across_days(gw)
        t = gw.new_key()
        r = t.http().post("/v1/chat/completions", json={
            "model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        gen_id = r.headers["x-neocloud-generation-id"]
        data = t.http().get("/v1/generation", params={"id": gen_id}).json()["data"]
        assert data["id"] == gen_id and data["streamed"] is False and data["cancelled"] is False
        assert Decimal(str(data["total_cost"])) == Decimal(t.usage()[0]["cost"]) > 0
        other = gw.new_key()
        assert other.http().get("/v1/generation", params={"id": gen_id}).status_code == 404
    finally:
        stop(gw.proc)


def test_postgres_old_usage_events_get_the_defaults(pg_schema: str) -> None:
    async def run() -> Any:
        conn = await asyncpg.connect(DSN)
        try:
            await conn.execute(f"CREATE SCHEMA {pg_schema}; SET search_path TO {pg_schema}")
            await conn.execute("CREATE TABLE kiln_schema_version (version INTEGER NOT NULL);"
                               " INSERT INTO kiln_schema_version VALUES (2)")
            for migration in migrations("postgres")[:2]:
                await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO usage_events (id, created_at, org_id, project_id, key_id, model, endpoint,"
                " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost_nano, status, cancelled,"
                " ttft_ms, duration_ms) VALUES ('gen-old', 1.5, 'o', 'p', 'k', 'm', 'completions',"
                " 3, 1, 2, 0, 77, 'ok', TRUE, NULL, 12.0)")
        finally:
            await conn.close()
        behind = PostgresStore(DSN, pg_schema)
        try:
            assert "usage_event_details" in await behind.migrate()  # PostgreSQL migrates by `kiln migrate`
        finally:
            await behind.close()
        store = PostgresStore(DSN, pg_schema)
        await store.open()
        try:
            return await store.get_usage("gen-old")
        finally:
            await store.close()

    event = asyncio.run(run())
    assert (event.cost_nano, event.cancelled, event.streamed, event.finish_reason, event.backend) == (
        77, True, False, None, None)

"""Usage read back: GET /v1/generation for a caller's own events, and the admin's usage
summary (GROUP BY day, org, project, key, model, endpoint; JSON and CSV).

Real gateway and simulator over HTTP; `check_summary_across_days` runs on SQLite here and
on PostgreSQL in test_postgres.py.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import asyncio
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import ADMIN_KEY, Gateway, Sim, Tenant, catalog_toml, start_gateway, stop
from kiln.store.schema import migrations
from kiln.store.sqlite import SQLiteStore

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16}


def lookup(gw: Gateway, gen_id: str | None, headers: dict[str, str]) -> httpx.Response:
    params = {} if gen_id is None else {"id": gen_id}
    return httpx.get(gw.url + "/v1/generation", params=params, headers=headers, timeout=30)


def bearer(t: Tenant) -> dict[str, str]:
    return {"Authorization": f"Bearer {t.key}"}


def assert_openai_error(r: httpx.Response, status: int, type_: str, code: str | None, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (type_, code, param), err
    assert err["message"]


# -- GET /v1/generation ------------------------------------------------------------------------


def test_generation_of_a_completion(tenant: Tenant) -> None:
    raw = tenant.openai().chat.completions.with_raw_response.create(model="qwen3-32b", **CHAT)
    reply = json.loads(raw.http_response.content, parse_float=Decimal)
    gen_id = raw.headers["x-neocloud-generation-id"]

    r = lookup(tenant.gw, gen_id, bearer(tenant))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    data = json.loads(r.content, parse_float=Decimal)["data"]
    usage = reply["usage"]
    assert data["id"] == gen_id
    assert data["model"] == "qwen3-32b" and data["endpoint"] == "chat.completions"
    assert data["tokens_prompt"] == data["native_tokens_prompt"] == usage["prompt_tokens"] > 0
    assert data["tokens_completion"] == data["native_tokens_completion"] == usage["completion_tokens"] > 0
    assert data["native_tokens_cached"] == (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert data["native_tokens_reasoning"] == (usage.get("completion_tokens_details") or {}).get(
        "reasoning_tokens", 0)
    assert isinstance(data["total_cost"], Decimal) and data["total_cost"] == usage["cost"] > 0  # exact
    assert (data["streamed"], data["cancelled"], data["status"]) == (False, False, "ok")
    assert data["finish_reason"] == reply["choices"][0]["finish_reason"]
    assert isinstance(data["latency"], int) and data["latency"] >= 0
    assert data["time_to_first_token"] is None  # measured on streams only
    created = datetime.fromisoformat(data["created_at"])
    assert created.tzinfo is not None and abs(created.timestamp() - datetime.now(timezone.utc).timestamp()) < 120
    assert "backend" not in data and "key_id" not in data  # nothing about the operator's servers


def test_generation_of_a_stream_with_x_api_key(tenant: Tenant) -> None:
    with tenant.openai().chat.completions.with_streaming_response.create(
        model="gpt-oss-120b", stream=True, stream_options={"include_usage": True}, **CHAT
    ) as resp:
        gen_id = resp.headers["x-neocloud-generation-id"]
        chunks = list(resp.parse())
    cost = Decimal(str(chunks[-1].usage.model_extra["cost"]))
    r = lookup(tenant.gw, gen_id, {"x-api-key": tenant.key})
    assert r.status_code == 200, r.text
    data = json.loads(r.content, parse_float=Decimal)["data"]
    assert data["streamed"] is True and data["model"] == "gpt-oss-120b"
    assert data["total_cost"] == cost
    assert isinstance(data["time_to_first_token"], int) and 0 <= data["time_to_first_token"] <= data["latency"]


def test_generation_of_another_key_is_not_found(gateway: Gateway) -> None:
    owner, other = gateway.new_key(), gateway.new_key()
    same_org = gateway.admin.post("/keys", json={"project_id": owner.project_id}).json()["key"]
    r = owner.http().post("/v1/chat/completions", json={"model": "qwen3-32b", **CHAT})
    gen_id = r.headers["x-neocloud-generation-id"]
    for key in (other.key, same_org):  # another organisation's key, and another key of the same project
        assert_openai_error(lookup(gateway, gen_id, {"Authorization": f"Bearer {key}"}),
                            404, "not_found_error", "generation_not_found", "id")
    unknown = lookup(gateway, "gen-" + "0" * 24, bearer(owner))
    assert_openai_error(unknown, 404, "not_found_error", "generation_not_found", "id")
    assert lookup(gateway, gen_id, bearer(owner)).status_code == 200


def test_generation_needs_a_key_and_an_id(tenant: Tenant) -> None:
    assert_openai_error(lookup(tenant.gw, "gen-x", {}), 401, "authentication_error", "invalid_api_key", None)
    assert_openai_error(lookup(tenant.gw, "gen-x", {"Authorization": "Bearer sk-kiln-nope"}),
                        401, "authentication_error", "invalid_api_key", None)
    assert_openai_error(lookup(tenant.gw, None, bearer(tenant)), 400, "invalid_request_error", None, "id")
    assert_openai_error(lookup(tenant.gw, "", bearer(tenant)), 400, "invalid_request_error", None, "id")
    admin = lookup(tenant.gw, "gen-x", {"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 401  # the admin credential is not an API key


def test_admin_usage_events_carry_the_new_fields(tenant: Tenant) -> None:
    tenant.http().post("/v1/chat/completions", json={"model": "qwen3-32b", **CHAT})
    with tenant.http().stream("POST", "/v1/chat/completions",
                              json={"model": "qwen3-32b", "stream": True, **CHAT}) as r:
        r.read()
    events = tenant.usage()
    assert sorted(e["streamed"] for e in events) == [False, True]
    assert {e["finish_reason"] for e in events} <= {"stop", "length"} and all(e["finish_reason"] for e in events)
    assert all(e["backend"].startswith("http://127.0.0.1:") for e in events)


def test_old_usage_events_get_the_defaults(tmp_path: Path) -> None:
    """A database from before the migration keeps its events, read with streamed false."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    for number, migration in enumerate(migrations("sqlite")[:2], start=1):
        db.executescript(f"BEGIN; {migration.sql}; PRAGMA user_version = {number}; COMMIT;")
    db.execute("INSERT INTO usage_events (id, created_at, org_id, project_id, key_id, model, endpoint,"
               " prompt_tokens, cached_tokens, completion_tokens, reasoning_tokens, cost_nano, status, cancelled,"
               " ttft_ms, duration_ms) VALUES ('gen-old', 1.5, 'o', 'p', 'k', 'm', '/v1/completions',"
               " 3, 1, 2, 0, 77, 'ok', 1, NULL, 12.0)")
    db.close()

    async def read() -> Any:
        store = SQLiteStore(path)
        await store.open()
        try:
            return await store.get_usage("gen-old"), await store.get_usage("gen-missing")
        finally:
            await store.close()

    event, missing = asyncio.run(read())
    assert missing is None
    assert (event.cost_nano, event.cancelled, event.streamed, event.finish_reason, event.backend) == (
        77, True, False, None, None)


# -- admin usage summary ------------------------------------------------------------------------


def summary(gw: Gateway, **params: str) -> list[dict[str, Any]]:
    r = gw.admin.get("/usage/summary", params=params)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    return body["data"]


def _send(t: Tenant, model: str, stream: bool = False) -> None:
    body = {"model": model, "stream": stream, **CHAT}
    if stream:
        with t.http().stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            r.read()
    else:
        r = t.http().post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


def check_summary_across_days(gw: Gateway) -> None:
    """Requests on two UTC days (the gateway's movable clock), summed by every grouping."""
    t, other = gw.new_key(), gw.new_key()
    second = gw.admin.post("/keys", json={"project_id": t.project_id, "name": "second"}).json()
    _send(t, "qwen3-32b")
    _send(t, "gpt-oss-120b", stream=True)
    r = gw.http(second["key"]).post("/v1/chat/completions", json={"model": "qwen3-32b", **CHAT})
    assert r.status_code == 200
    _send(other, "qwen3-32b")
    assert gw.admin.post("/clock", json={"seconds": 86400}).status_code == 200
    _send(t, "qwen3-32b")
    events = [e for e in gw.admin.get("/usage", params={"org_id": t.org_id}).json()["data"]]
    assert len(events) == 4

    def totals(rows: list[dict[str, Any]]) -> tuple[int, int, int, int, int, Decimal]:
        return (sum(r["requests"] for r in rows), sum(r["prompt_tokens"] for r in rows),
                sum(r["cached_tokens"] for r in rows), sum(r["completion_tokens"] for r in rows),
                sum(r["reasoning_tokens"] for r in rows), sum(Decimal(r["cost"]) for r in rows))

    expected = (4, *(sum(e[n] for e in events) for n in
                     ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")),
                sum(Decimal(e["cost"]) for e in events))
    [whole] = summary(gw, org_id=t.org_id)
    assert set(whole) == {"requests", "prompt_tokens", "cached_tokens", "completion_tokens",
                          "reasoning_tokens", "cost"}
    assert totals([whole]) == expected

    days = sorted({datetime.fromtimestamp(e["created_at"], timezone.utc).strftime("%Y-%m-%d") for e in events})
    assert len(days) == 2
    by_day_model = summary(gw, org_id=t.org_id, by="day,model")
    assert [(r["day"], r["model"], r["requests"]) for r in by_day_model] == [
        (days[0], "gpt-oss-120b", 1), (days[0], "qwen3-32b", 2), (days[1], "qwen3-32b", 1)]
    assert totals(by_day_model) == expected
    for row in by_day_model:
        mine = [e for e in events if e["model"] == row["model"]
                and datetime.fromtimestamp(e["created_at"], timezone.utc).strftime("%Y-%m-%d") == row["day"]]
        assert Decimal(row["cost"]) == sum(Decimal(e["cost"]) for e in mine)
        assert row["completion_tokens"] == sum(e["completion_tokens"] for e in mine)

    by_key = summary(gw, project_id=t.project_id, by="key")
    assert {r["key_id"]: r["requests"] for r in by_key} == {t.key_id: 3, second["id"]: 1}
    by_org = {r["org_id"]: r["requests"] for r in summary(gw, by="org")}
    assert by_org[t.org_id] == 4 and by_org[other.org_id] == 1
    assert summary(gw, key_id=t.key_id, model="gpt-oss-120b", by="endpoint,project") == [
        {**summary(gw, key_id=t.key_id, model="gpt-oss-120b")[0],
         "endpoint": "chat.completions", "project_id": t.project_id}]
    later = datetime.fromtimestamp(max(e["created_at"] for e in events), timezone.utc)
    assert [r["day"] for r in summary(gw, org_id=t.org_id, by="day", since=days[1])] == [days[1]]
    assert [r["day"] for r in summary(gw, org_id=t.org_id, by="day", until=days[1])] == [days[0]]
    assert summary(gw, org_id=t.org_id, since=str(later.timestamp() + 1)) == []

    r = gw.admin.get("/usage/summary.csv", params={"org_id": t.org_id, "by": "day,model"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert "attachment" in r.headers["content-disposition"]
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert list(rows[0]) == ["day", "model", "requests", "prompt_tokens", "cached_tokens",
                             "completion_tokens", "reasoning_tokens", "cost"]
    assert [{k: (v if k in ("day", "model", "cost") else int(v)) for k, v in row.items()} for row in rows] \
        == by_day_model


@pytest.fixture(scope="module")
def clock_gateway(sim: Sim) -> Iterator[Gateway]:
    gw = start_gateway(catalog_toml(sim.url), env={"KILN_TEST_CLOCK": "1"})
    yield gw
    stop(gw.proc)


def test_usage_summary_across_days_on_sqlite(clock_gateway: Gateway) -> None:
    check_summary_across_days(clock_gateway)


def test_usage_summary_refuses_bad_queries(gateway: Gateway) -> None:
    for params, param in (({"by": "day,colour"}, "by"), ({"by": "day,day"}, "by"), ({"since": "yesterday"}, "since")):
        r = gateway.admin.get("/usage/summary", params=params)
        assert_openai_error(r, 400, "invalid_request_error", None, param)
    for path in ("/usage/summary", "/usage/summary.csv"):
        r = httpx.get(gateway.url + "/admin/v1" + path, timeout=30)
        assert_openai_error(r, 401, "authentication_error", "invalid_api_key", None)
    assert summary(gateway, org_id="org_nobody") == []

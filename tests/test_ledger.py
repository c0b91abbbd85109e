"""The usage ledger: one exact, durable usage event per metered request.

Costs are compared as exact decimals: responses are parsed with
parse_float=Decimal so usage.cost is never rounded through a float.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import ADMIN_KEY, Gateway, Sim, Tenant, catalog_cost, catalog_toml, free_port, stop, usage_cost

MILLION = Decimal(1_000_000)
NANO = Decimal("0.000000001")


def chat_body(content: str = "Hello!", model: str = "qwen3-32b", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 60, **extra}


def post_json(t: Tenant, body: dict[str, Any]) -> tuple[httpx.Response, dict[str, Any]]:
    with t.http() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r, json.loads(r.content, parse_float=Decimal)


def post_stream(t: Tenant, body: dict[str, Any]) -> tuple[httpx.Response, list[dict[str, Any]], bytes]:
    """POST a streaming request and read it to the end; returns (response, data chunks, raw bytes)."""
    with t.http() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    chunks = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:], parse_float=Decimal))
    assert raw.rstrip().endswith(b"data: [DONE]")
    return r, chunks, raw


def event_by_id(t: Tenant, gen_id: str) -> dict[str, Any]:
    matches = [e for e in t.usage() if e["id"] == gen_id]
    assert len(matches) == 1, (gen_id, t.usage())
    return matches[0]


def db_event(data_dir: Path, gen_id: str) -> dict[str, Any] | None:
    db = sqlite3.connect(f"file:{data_dir / 'kiln.db'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        row = db.execute("SELECT * FROM usage_events WHERE id = ?", (gen_id,)).fetchone()
        return dict(row) if row else None
    finally:
        db.close()


def assert_event_matches(event: dict[str, Any], t: Tenant, gen_id: str, model: str, usage: dict[str, Any]) -> None:
    assert event["id"] == gen_id
    assert event["org_id"] == t.org_id
    assert event["project_id"] == t.project_id
    assert event["key_id"] == t.key_id
    assert event["model"] == model
    assert event["endpoint"] == "chat.completions"
    assert event["prompt_tokens"] == usage["prompt_tokens"]
    assert event["completion_tokens"] == usage["completion_tokens"]
    assert event["cached_tokens"] == ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    assert event["reasoning_tokens"] == ((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    assert Decimal(event["cost"]) == usage["cost"]
    assert event["status"] == "ok"
    assert event["cancelled"] is False
    assert event["duration_ms"] > 0
    assert abs(event["created_at"] - time.time()) < 60


# -- one event per request, equal to the response -----------------------------------------


def test_json_request_writes_one_matching_event(tenant: Tenant) -> None:
    r, data = post_json(tenant, chat_body())
    gen_id = r.headers["x-neocloud-generation-id"]
    assert gen_id.startswith("gen-")
    usage = data["usage"]
    assert usage["cost"] > 0
    [event] = tenant.usage()
    assert_event_matches(event, tenant, gen_id, "qwen3-32b", usage)
    assert event["reasoning_tokens"] > 0  # qwen3 reasons on the simulator


def test_streaming_request_writes_one_matching_event_with_ttft(tenant: Tenant) -> None:
    r, chunks, _ = post_stream(
        tenant, chat_body(stream_options={"include_usage": True}, sim={"ttft_ms": 250, "token_delay_ms": 5})
    )
    gen_id = r.headers["x-neocloud-generation-id"]
    final = chunks[-1]
    assert final["choices"] == []
    usage = final["usage"]
    assert usage["cost"] > 0
    [event] = tenant.usage()
    assert_event_matches(event, tenant, gen_id, "qwen3-32b", usage)
    assert event["ttft_ms"] is not None
    assert 250 <= event["ttft_ms"] <= event["duration_ms"]
    assert event["duration_ms"] >= 250 + 5 * (usage["completion_tokens"] - 2)


def test_json_duration_covers_backend_time(tenant: Tenant) -> None:
    r, data = post_json(tenant, chat_body(sim={"delay_ms": 300}))
    event = event_by_id(tenant, r.headers["x-neocloud-generation-id"])
    assert event["duration_ms"] >= 300
    assert event["status"] == "ok"


def test_stream_without_include_usage_is_still_metered(tenant: Tenant) -> None:
    r, chunks, _ = post_stream(tenant, chat_body())
    assert all("usage" not in c or c["usage"] is None for c in chunks), "usage chunk must be removed"
    event = event_by_id(tenant, r.headers["x-neocloud-generation-id"])
    assert event["prompt_tokens"] > 0 and event["completion_tokens"] > 0
    expected = catalog_cost("qwen3-32b", event["prompt_tokens"], event["cached_tokens"], event["completion_tokens"],
                            rounded=False)
    assert Decimal(event["cost"]) == expected > 0


def test_alias_is_metered_under_the_model_id(tenant: Tenant) -> None:
    r, data = post_json(tenant, chat_body(model="claude-opus-5-5"))
    event = event_by_id(tenant, r.headers["x-neocloud-generation-id"])
    assert event["model"] == "qwen3-32b"
    assert Decimal(event["cost"]) == usage_cost("qwen3-32b", data["usage"], rounded=False) == data["usage"]["cost"]


def test_sdk_usage_matches_the_event(tenant: Tenant) -> None:
    raw = tenant.openai().chat.completions.with_raw_response.create(**chat_body())
    resp = raw.parse()
    event = event_by_id(tenant, raw.headers["x-neocloud-generation-id"])
    assert event["prompt_tokens"] == resp.usage.prompt_tokens
    assert event["completion_tokens"] == resp.usage.completion_tokens
    assert Decimal(event["cost"]) == Decimal(str(resp.usage.model_extra["cost"]))


# -- exact cost ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_qwen_cost_is_exact_from_catalog_prices(tenant: Tenant, stream: bool) -> None:
    body = chat_body("Price check " + uuid.uuid4().hex)
    if stream:
        r, chunks, _ = post_stream(tenant, {**body, "stream_options": {"include_usage": True}})
        usage = chunks[-1]["usage"]
    else:
        r, data = post_json(tenant, body)
        usage = data["usage"]
    expected = usage_cost("qwen3-32b", usage, rounded=False)
    assert expected == expected.quantize(NANO), "qwen3 prices are whole nanodollars per token"
    event = event_by_id(tenant, r.headers["x-neocloud-generation-id"])
    assert Decimal(event["cost"]) == expected
    assert usage["cost"] == expected


@pytest.mark.parametrize("max_tokens", [7, 60])
def test_gpt_oss_cost_is_within_half_a_nanodollar(tenant: Tenant, max_tokens: int) -> None:
    """gpt-oss output costs 62.5 nanodollars a token: amounts are whole nanodollars, rounded once."""
    r, data = post_json(tenant, chat_body(model="gpt-oss-120b", max_tokens=max_tokens))
    usage = data["usage"]
    exact = usage_cost("gpt-oss-120b", usage, rounded=False)
    event = event_by_id(tenant, r.headers["x-neocloud-generation-id"])
    cost = Decimal(event["cost"])
    assert cost == cost.quantize(NANO)
    assert abs(cost - exact) <= NANO / 2
    assert cost == exact.quantize(NANO, rounding=ROUND_HALF_UP)
    assert usage["cost"] == cost


def test_cached_tokens_are_billed_at_the_cached_price(tenant: Tenant) -> None:
    words = " ".join(f"word{i}" for i in range(120))
    prompt = f"Nonce {uuid.uuid4().hex}. Summarise: {words}"
    body = chat_body(prompt)
    r1, d1 = post_json(tenant, body)
    r2, d2 = post_json(tenant, body)
    u1, u2 = d1["usage"], d2["usage"]
    assert u1["prompt_tokens"] >= 64
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= u2["prompt_tokens"]
    e1 = event_by_id(tenant, r1.headers["x-neocloud-generation-id"])
    e2 = event_by_id(tenant, r2.headers["x-neocloud-generation-id"])
    assert e2["cached_tokens"] == cached
    assert Decimal(e1["cost"]) == usage_cost("qwen3-32b", u1, rounded=False)
    assert Decimal(e2["cost"]) == usage_cost("qwen3-32b", u2, rounded=False) == u2["cost"]
    if u1["completion_tokens"] == u2["completion_tokens"]:
        saving = cached * (Decimal("0.10") - Decimal("0.05")) / MILLION
        assert Decimal(e1["cost"]) - Decimal(e2["cost"]) == saving


def test_cached_tokens_in_a_stream(tenant: Tenant) -> None:
    prompt = f"Stream nonce {uuid.uuid4().hex}. " + " ".join(f"item{i}" for i in range(100))
    post_json(tenant, chat_body(prompt))
    r, chunks, _ = post_stream(tenant, chat_body(prompt, stream_options={"include_usage": True}))
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    event = event_by_id(tenant, r.headers["x-neocloud-generation-id"])
    assert event["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert Decimal(event["cost"]) == usage_cost("qwen3-32b", usage, rounded=False) == usage["cost"]


# -- totals --------------------------------------------------------------------------------


def test_credits_consumed_equal_the_exact_sum_of_event_costs(gateway: Gateway) -> None:
    t = gateway.new_key(credits="7.123456789")
    response_costs: list[Decimal] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(4):
                model = "gpt-oss-120b" if (i + j) % 3 == 0 else "qwen3-32b"
                body = chat_body(f"thread {i} request {j}", model=model, max_tokens=5 + i + j)
                if j % 2:
                    _, chunks, _ = post_stream(t, {**body, "stream_options": {"include_usage": True}})
                    cost = chunks[-1]["usage"]["cost"]
                else:
                    _, data = post_json(t, body)
                    cost = data["usage"]["cost"]
                with lock:
                    response_costs.append(cost)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    # A few sequential ones too, including streams without the usage chunk.
    for k in range(3):
        post_stream(t, chat_body(f"sequential {k}"))
    events = t.usage()
    assert len(events) == 6 * 4 + 3
    assert len({e["id"] for e in events}) == len(events)
    event_sum = sum((Decimal(e["cost"]) for e in events), Decimal(0))
    org = t.org()
    granted, credits = Decimal(org["total_granted"]), Decimal(org["credits"])
    assert granted == Decimal("7.123456789")
    assert granted - credits == event_sum
    assert Decimal(org["total_spend"]) == event_sum
    assert Decimal(org["month_spend"]) == event_sum
    assert org["usage_events"] == len(events)
    # The listing is newest first: the three sequential streams (no usage chunk) are events[:3].
    sequential = sum((Decimal(e["cost"]) for e in events[:3]), Decimal(0))
    assert len(response_costs) == 24
    assert sum(response_costs, Decimal(0)) == event_sum - sequential
    key_spend = Decimal(t.http().get("/v1/key").json()["spend"])
    assert key_spend == event_sum
    assert org["in_flight"] == 0


def test_response_costs_sum_to_ledger_costs(tenant: Tenant) -> None:
    costs = []
    ids = []
    for i in range(4):
        if i % 2:
            r, chunks, _ = post_stream(tenant, chat_body(f"sum {i}", stream_options={"include_usage": True}))
            costs.append(chunks[-1]["usage"]["cost"])
        else:
            r, data = post_json(tenant, chat_body(f"sum {i}"))
            costs.append(data["usage"]["cost"])
        ids.append(r.headers["x-neocloud-generation-id"])
    events = {e["id"]: Decimal(e["cost"]) for e in tenant.usage()}
    assert set(events) == set(ids)
    assert [events[i] for i in ids] == costs
    org = tenant.org()
    assert Decimal(org["total_granted"]) - Decimal(org["credits"]) == sum(costs, Decimal(0))


def test_rejected_requests_write_no_event(tenant: Tenant, sim: Sim) -> None:
    with tenant.http() as c:
        assert c.post("/v1/chat/completions", json={"model": "qwen3-32b", "messages": []}).status_code == 400
        assert c.post("/v1/chat/completions", json={"model": "qwen3-32b"}).status_code == 400
        assert c.post("/v1/chat/completions", json=chat_body(model="no-such-model")).status_code == 404
        assert c.post("/v1/chat/completions", content=b"{oops",
                      headers={"content-type": "application/json"}).status_code == 400
    assert tenant.usage() == []
    org = tenant.org()
    assert org["usage_events"] == 0 and Decimal(org["credits"]) == 10


def test_client_leaving_mid_stream_is_billed_for_what_was_generated(tenant: Tenant) -> None:
    body = chat_body("leave early", max_tokens=200, stream=True,
                     sim={"reply_tokens": 150, "token_delay_ms": 30})
    seen = 0
    with tenant.http() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        gen_id = r.headers["x-neocloud-generation-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= 5:
                break
    deadline = time.monotonic() + 10
    events: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not events:
        events = [e for e in tenant.usage() if e["id"] == gen_id]
        time.sleep(0.05)
    assert len(events) == 1, "a cancelled stream must still write its usage event"
    event = events[0]
    assert event["cancelled"] is True
    assert event["status"] == "cancelled"
    assert event["prompt_tokens"] > 0
    assert seen - 1 <= event["completion_tokens"] < 150
    expected = catalog_cost("qwen3-32b", event["prompt_tokens"], event["cached_tokens"], event["completion_tokens"],
                            rounded=False)
    assert Decimal(event["cost"]) == expected > 0
    org = tenant.org()
    assert Decimal(org["total_granted"]) - Decimal(org["credits"]) == Decimal(event["cost"])
    assert org["in_flight"] == 0


# -- durability -----------------------------------------------------------------------------


def journaled(data_dir: Path) -> dict[str, dict[str, Any]]:
    """The usage events in the ledger's journal (appended, not yet committed), by id."""
    events = {}
    for segment in sorted((data_dir / "journal").glob("*.jsonl")):
        for line in segment.read_bytes().splitlines():
            event = json.loads(line)
            events[event["id"]] = event
    return events


def durable_cost(data_dir: Path, gen_id: str) -> int:
    """The event's cost where it is durable: committed to the SQLite file, or in the journal."""
    row = db_event(data_dir, gen_id)
    if row is None:
        row = journaled(data_dir).get(gen_id)
    assert row is not None, "the usage event was not durable before the response"
    return int(row["cost_nano"])


def test_event_is_durable_when_the_json_response_arrives(tenant: Tenant) -> None:
    r, data = post_json(tenant, chat_body())
    gen_id = r.headers["x-neocloud-generation-id"]
    assert Decimal(durable_cost(tenant.gw.data_dir, gen_id)) * NANO == data["usage"]["cost"]
    # Reading usage commits what is journaled first: the client sees its event at once.
    with tenant.http() as c:
        stats = c.get("/v1/generation", params={"id": gen_id})
    assert stats.status_code == 200
    assert json.loads(stats.content, parse_float=Decimal)["data"]["total_cost"] == data["usage"]["cost"]
    row = db_event(tenant.gw.data_dir, gen_id)
    assert row is not None and row["key_id"] == tenant.key_id
    assert row["prompt_tokens"] == data["usage"]["prompt_tokens"]


def test_generation_ids_sort_in_the_order_the_requests_were_made(tenant: Tenant) -> None:
    """Time-ordered ids: the ledger's primary-key index grows at its end. With random ids every
    commit rewrites pages all over the index: three times the disk per event, and CPU and memory
    per event that grow with the ledger."""
    made = []
    for _ in range(5):
        r, _ = post_json(tenant, chat_body())
        made.append(r.headers["x-neocloud-generation-id"])
        time.sleep(0.002)  # ids are ordered to the millisecond, random within one
    assert len(set(made)) == 5
    assert len(tenant.usage()) == 5  # reads commit what is journaled
    db = sqlite3.connect(f"file:{tenant.gw.data_dir / 'kiln.db'}?mode=ro", uri=True)
    try:
        stored = [row[0] for row in db.execute("SELECT id FROM usage_events WHERE key_id = ? ORDER BY id",
                                               (tenant.key_id,))]
    finally:
        db.close()
    assert stored == made


def test_event_is_durable_when_the_stream_ends(tenant: Tenant) -> None:
    with tenant.http() as c, c.stream("POST", "/v1/chat/completions",
                                      json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        gen_id = r.headers["x-neocloud-generation-id"]
        saw_cost = None
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:], parse_float=Decimal)["usage"]
                if usage and "cost" in usage:
                    saw_cost = usage["cost"]
                    # The cost chunk is sent once the event is durable.
                    assert Decimal(durable_cost(tenant.gw.data_dir, gen_id)) * NANO == saw_cost
    assert saw_cost is not None


def _wait_healthy(url: str, proc: subprocess.Popen[Any], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"gateway did not start: {log.read_text()}")


class Restartable:
    """`python -m kiln serve` on a fixed data dir, started and stopped at will."""

    def __init__(self, sim_url: str) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="kiln-ledger-"))
        self.config = self.data_dir / "kiln.toml"
        self.config.write_text(catalog_toml(sim_url))
        self.proc: subprocess.Popen[Any] | None = None
        self.gw: Gateway | None = None
        self.starts = 0

    def set_server(self, lines: str) -> None:
        """More [server] settings for the next start."""
        self.config.write_text(self.config.read_text().replace("[server]\n", f"[server]\n{lines}\n", 1))

    def start(self) -> Gateway:
        port = free_port()
        self.starts += 1
        log = self.data_dir / f"gateway-{self.starts}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln", "serve", "--config", str(self.config), "--port", str(port),
             "--data-dir", str(self.data_dir)],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
            env={**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY},
        )
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, self.proc, log)
        self.gw = Gateway(url, self.proc, self.data_dir, log)  # type: ignore[arg-type]
        return self.gw

    def stop(self, kill: bool = False) -> int | None:
        assert self.proc is not None
        if self.gw is not None:
            self.gw.admin.close()
        if kill:
            self.proc.kill()
            rc = self.proc.wait(10)
        else:
            stop(self.proc)  # type: ignore[arg-type]
            rc = self.proc.returncode
        self.proc = None
        return rc


@pytest.fixture
def restartable(sim: Sim) -> Iterator[Restartable]:
    r = Restartable(sim.url)
    yield r
    if r.proc is not None:
        r.stop(kill=True)


def _snapshot(gw: Gateway, t: Tenant) -> dict[str, Any]:
    org = gw.admin.get(f"/orgs/{t.org_id}").json()
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {t.key}"}) as c:
        key = c.get("/v1/key").json()
    usage = gw.admin.get("/usage", params={"org_id": t.org_id, "limit": 1000}).json()["data"]
    return {
        "credits": org["credits"], "total_granted": org["total_granted"], "total_spend": org["total_spend"],
        "usage_events": org["usage_events"], "month_spend": org["month_spend"],
        "monthly_budget": org["monthly_budget"], "key_spend": key["spend"], "key_status": key["status"],
        "spend_limit": key["spend_limit"],
        "events": sorted((e["id"], e["cost"], e["prompt_tokens"], e["completion_tokens"]) for e in usage),
    }


def _traffic(gw: Gateway, t: Tenant, n: int) -> None:
    t.gw = gw
    for i in range(n):
        if i % 2:
            post_stream(t, chat_body(f"restart {i}", stream_options={"include_usage": True}))
        else:
            post_json(t, chat_body(f"restart {i}"))


@pytest.mark.parametrize("kill", [False, True], ids=["graceful", "sigkill"])
def test_balances_and_spend_survive_a_restart(restartable: Restartable, kill: bool) -> None:
    gw = restartable.start()
    t = gw.new_key(credits="3", monthly_budget="50")
    gw.admin.patch(f"/keys/{t.key_id}", json={"spend_limit": "2"})
    _traffic(gw, t, 6)
    before = _snapshot(gw, t)
    assert before["usage_events"] == 6
    assert Decimal(before["total_granted"]) - Decimal(before["credits"]) == Decimal(before["total_spend"]) > 0
    restartable.stop(kill=kill)

    gw = restartable.start()
    t.gw = gw
    after = _snapshot(gw, t)
    assert after == before
    # The key still works after the restart and keeps billing from where it was.
    r, data = post_json(t, chat_body("after restart"))
    org = gw.admin.get(f"/orgs/{t.org_id}").json()
    assert Decimal(org["credits"]) == Decimal(before["credits"]) - data["usage"]["cost"]
    assert org["usage_events"] == 7


def test_suspension_and_limits_survive_a_restart(restartable: Restartable) -> None:
    gw = restartable.start()
    t = gw.new_key(credits="1", concurrency_limit=3, rpm_limit=500)
    other = gw.admin.post("/keys", json={"project_id": t.project_id, "name": "other"}).json()
    gw.admin.post(f"/keys/{t.key_id}/suspend")
    gw.admin.post(f"/keys/{other['id']}/revoke")
    restartable.stop()
    gw = restartable.start()
    with httpx.Client(base_url=gw.url) as c:
        assert c.post("/v1/chat/completions", json=chat_body(),
                      headers={"Authorization": f"Bearer {t.key}"}).status_code == 403
        assert c.post("/v1/chat/completions", json=chat_body(),
                      headers={"Authorization": f"Bearer {other['key']}"}).status_code == 403
    org = gw.admin.get(f"/orgs/{t.org_id}").json()
    assert org["concurrency_limit"] == 3 and org["rpm_limit"] == 500
    assert gw.admin.post(f"/keys/{other['id']}/reactivate").status_code == 409
    assert gw.admin.post(f"/keys/{t.key_id}/reactivate").status_code == 200
    with httpx.Client(base_url=gw.url) as c:
        assert c.post("/v1/chat/completions", json=chat_body(),
                      headers={"Authorization": f"Bearer {t.key}"}).status_code == 200


# -- the journal: durable before the commit ---------------------------------------------------

def _cost_nano(data: dict[str, Any]) -> int:
    return int(data["usage"]["cost"] / NANO)


def test_journaled_events_survive_sigkill_before_their_commit(restartable: Restartable) -> None:
    """With commits held back (a 60 s linger), the responses' events are only in the journal when
    the gateway is killed; the next start commits them before it serves: each bills once."""
    restartable.set_server("ledger_linger_s = 60")
    gw = restartable.start()
    t = gw.new_key(credits="3")
    r1, d1 = post_json(t, chat_body("one"))
    r2, chunks, _ = post_stream(t, chat_body("two", stream_options={"include_usage": True}))
    ids = [r1.headers["x-neocloud-generation-id"], r2.headers["x-neocloud-generation-id"]]
    costs = [_cost_nano(d1), int(chunks[-1]["usage"]["cost"] / NANO)]
    assert all(db_event(gw.data_dir, i) is None for i in ids), "the commit was held back"
    journal = journaled(gw.data_dir)
    assert [journal[i]["cost_nano"] for i in ids] == costs
    restartable.stop(kill=True)

    gw = restartable.start()
    t.gw = gw
    assert [int(db_event(gw.data_dir, i)["cost_nano"]) for i in ids] == costs  # type: ignore[index]
    assert journaled(gw.data_dir) == {}, "the journal was emptied once committed"
    org = gw.admin.get(f"/orgs/{t.org_id}").json()
    assert org["usage_events"] == 2
    assert int(Decimal(org["credits"]) / NANO) == 3_000_000_000 - sum(costs)
    assert int(Decimal(org["total_spend"]) / NANO) == sum(costs)
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {t.key}"}) as c:
        assert int(Decimal(c.get("/v1/key").json()["spend"]) / NANO) == sum(costs)


def test_an_event_both_committed_and_journaled_bills_once(restartable: Restartable) -> None:
    """A crash between a commit and the journal's truncation leaves committed events in it: the
    store inserts each generation id once, so replaying them bills nothing twice."""
    restartable.set_server("ledger_linger_s = 60")
    gw = restartable.start()
    t = gw.new_key(credits="3")
    r, data = post_json(t, chat_body())
    gen_id = r.headers["x-neocloud-generation-id"]
    line = next(seg.read_bytes() for seg in (gw.data_dir / "journal").glob("*.jsonl") if seg.stat().st_size)
    assert gen_id.encode() in line
    with t.http() as c:  # a read commits it
        assert c.get("/v1/generation", params={"id": gen_id}).status_code == 200
    assert db_event(gw.data_dir, gen_id) is not None
    restartable.stop()
    (gw.data_dir / "journal" / "000000999999.jsonl").write_bytes(line)

    gw = restartable.start()
    org = gw.admin.get(f"/orgs/{t.org_id}").json()
    assert org["usage_events"] == 1
    assert int(Decimal(org["credits"]) / NANO) == 3_000_000_000 - _cost_nano(data)
    assert journaled(gw.data_dir) == {}


def test_reads_of_usage_see_every_journaled_event(restartable: Restartable) -> None:
    """The org's totals, the usage list and summary, and GET /v1/generation each commit what is
    journaled before they read, whatever the linger."""
    restartable.set_server("ledger_linger_s = 60")
    gw = restartable.start()
    t = gw.new_key(credits="3")
    total = sum(_cost_nano(post_json(t, chat_body(f"read {i}"))[1]) for i in range(3))
    assert int(Decimal(gw.admin.get(f"/orgs/{t.org_id}").json()["total_spend"]) / NANO) == total
    post_json(t, chat_body("one more"))
    assert len(gw.admin.get("/usage", params={"org_id": t.org_id}).json()["data"]) == 4
    post_json(t, chat_body("and another"))
    rows = gw.admin.get("/usage/summary", params={"org_id": t.org_id}).json()["data"]
    assert rows[0]["requests"] == 5


def test_a_top_up_keeps_the_cost_of_journaled_events(restartable: Restartable) -> None:
    """A top-up while events wait in the journal adds to the balance admission holds, which
    already counts them: taking the store's balance instead would forget their cost until
    the next start (credits granted, spent and left would no longer add up)."""
    restartable.set_server("ledger_linger_s = 60")
    gw = restartable.start()
    t = gw.new_key(credits="3")
    cost = sum(_cost_nano(post_json(t, chat_body(f"top-up {i}"))[1]) for i in range(2))
    topped = gw.admin.post(f"/orgs/{t.org_id}/credits", json={"amount": "10"})
    assert topped.status_code == 200, topped.text
    assert int(Decimal(topped.json()["credits"]) / NANO) == 13_000_000_000 - cost
    org = gw.admin.get(f"/orgs/{t.org_id}").json()
    assert org["usage_events"] == 2
    assert int(Decimal(org["credits"]) / NANO) == 13_000_000_000 - cost
    assert int(Decimal(org["total_spend"]) / NANO) == cost

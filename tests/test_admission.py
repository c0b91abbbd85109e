"""Admission control, exact under concurrency: credits, budgets, spend limits, rates, maintenance.

A gateway of its own (with a movable clock) and a simulator of its own, so the
simulator's in-flight statistics and the clock belong to these tests alone.
"""

from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from typing import Any, Iterator

import httpx
import pytest

from conftest import Gateway, Sim, Tenant, catalog_toml, start_gateway, start_sim, stop

OUT_PRICE = Decimal("0.30") / 1_000_000  # qwen3-32b output, USD per token
MSG = [{"role": "user", "content": "Write a long story."}]


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[Gateway, Sim]]:
    sim = start_sim("--model", "Qwen/Qwen3-32B", "--model", "gpt-oss-120b")
    gw = start_gateway(catalog_toml(sim.url), env={"KILN_TEST_CLOCK": "1"})
    yield gw, sim
    stop(gw.proc)
    stop(sim.proc)


def chat(t: Tenant, **body: Any) -> httpx.Response:
    with t.http() as c:
        return c.post("/v1/chat/completions", json={"model": "qwen3-32b", "messages": MSG, **body})


def advance(gw: Gateway, seconds: float) -> float:
    """Move the gateway's clock; returns its new time."""
    r = gw.admin.post("/clock", json={"seconds": seconds})
    assert r.status_code == 200, r.text
    return float(r.json()["time"])


def spend(t: Tenant) -> Decimal:
    return sum((Decimal(e["cost"]) for e in t.usage()), Decimal(0))


def assert_ledger_matches_credits(t: Tenant) -> None:
    org = t.org()
    assert Decimal(org["total_granted"]) - Decimal(org["credits"]) == spend(t) == Decimal(org["total_spend"])


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, list[str]]:
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, [r.text]
        return 200, [line async for line in r.aiter_lines() if line.startswith("data: ")]


# -- the budget under a burst ------------------------------------------------------------


def test_burst_of_200_streams_never_overspends_a_small_budget(env: tuple[Gateway, Sim]) -> None:
    gw, sim = env
    budget = Decimal("0.002")
    t = gw.new_key(credits="10", monthly_budget=str(budget), concurrency_limit=500, rpm_limit=100000)
    body = {"model": "qwen3-32b", "messages": MSG, "stream": True, "max_tokens": 128000,
            "sim": {"reply_tokens": 1500, "token_delay_ms": 2}}

    async def burst() -> list[tuple[int, list[str]]]:
        async with httpx.AsyncClient(base_url=gw.url, headers={"Authorization": f"Bearer {t.key}"},
                                     timeout=60, limits=httpx.Limits(max_connections=250)) as c:
            return await asyncio.gather(*(_stream(c, body) for _ in range(200)))

    results = asyncio.run(burst())
    admitted = [lines for status, lines in results if status == 200]
    refused = [lines for status, lines in results if status != 200]
    assert {status for status, _ in results} <= {200, 402}
    assert admitted, "agents asking for 128k tokens are admitted while money remains"
    assert refused, "the budget cannot serve 200 long streams"
    assert all('"budget_exceeded"' in lines[0] for lines in refused)
    cut = [lines for lines in admitted if any('"finish_reason":"length"' in line for line in lines)]
    assert cut, "streams that outrun the money end with finish_reason length"
    assert all(lines[-1] == "data: [DONE]" for lines in admitted)
    total = spend(t)
    print(f"\nburst: {len(admitted)} admitted, {len(refused)} refused (402), {len(cut)} cut at the money's end;"
          f" spend {total} of budget {budget}")
    # The documented bound: one upstream read per admitted stream past its reservation.
    bound = len(admitted) * 8 * OUT_PRICE
    assert total <= budget + bound, (total, budget, bound)
    assert total > budget * Decimal("0.8"), "the money is actually used, not stranded in reservations"
    assert len(t.usage()) == len(admitted)
    assert_ledger_matches_credits(t)
    # Small requests use up what is left; once it is gone nothing is admitted.
    for _ in range(50):
        r = chat(t, max_tokens=10)
        if r.status_code != 200:
            break
    assert r.status_code == 402 and r.json()["error"]["code"] == "budget_exceeded"
    assert spend(t) <= budget + bound
    assert_ledger_matches_credits(t)


def test_non_streaming_request_is_capped_to_what_the_credits_cover(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key(credits="0.0001")  # about 300 output tokens at 0.30/M
    r = chat(t, max_tokens=8000, sim={"reply_tokens": 2000})
    assert r.status_code == 200, r.text
    capped = int(r.headers["x-kiln-output-capped"])
    assert 0 < capped < 8000
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] <= capped
    assert Decimal(t.org()["credits"]) >= 0
    assert_ledger_matches_credits(t)


def test_stream_is_cut_cleanly_when_the_key_limit_runs_out(env: tuple[Gateway, Sim]) -> None:
    gw, sim = env
    t = gw.new_key(key_fields={"spend_limit": "0.0003"})  # about 1000 output tokens
    with t.http() as c, c.stream("POST", "/v1/chat/completions", json={
        "model": "qwen3-32b", "messages": MSG, "stream": True, "stream_options": {"include_usage": True},
        "sim": {"reply_tokens": 5000},
    }) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    finish = [line for line in lines if '"finish_reason":"length"' in line]
    assert len(finish) == 1 and "kiln_note" in finish[0]
    key = t.http().get("/v1/key").json()
    assert Decimal(key["spend"]) <= Decimal("0.0003") + 8 * OUT_PRICE
    assert_ledger_matches_credits(t)
    for _ in range(50):  # what is left covers a few small capped requests, then nothing
        r = chat(t)
        if r.status_code != 200:
            break
    assert r.json()["error"]["code"] == "key_spend_limit_reached"
    assert Decimal(t.http().get("/v1/key").json()["spend"]) <= Decimal("0.0003") + 8 * OUT_PRICE


# -- concurrency -----------------------------------------------------------------------------


def test_100_simultaneous_requests_with_limit_8(env: tuple[Gateway, Sim]) -> None:
    gw, sim = env
    t = gw.new_key(concurrency_limit=8, rpm_limit=100000)
    sim.reset()
    body = {"model": "qwen3-32b", "messages": MSG, "max_tokens": 5, "sim": {"delay_ms": 1500}}

    async def burst() -> list[tuple[int, float, httpx.Headers]]:
        async with httpx.AsyncClient(base_url=gw.url, headers={"Authorization": f"Bearer {t.key}"},
                                     timeout=30, limits=httpx.Limits(max_connections=120)) as c:
            async def one() -> tuple[int, float, httpx.Headers]:
                start = time.monotonic()
                r = await c.post("/v1/chat/completions", json=body)
                return r.status_code, time.monotonic() - start, r.headers

            return await asyncio.gather(*(one() for _ in range(100)))

    results = asyncio.run(burst())
    ok = [r for r in results if r[0] == 200]
    limited = [r for r in results if r[0] == 429]
    assert len(ok) == 8 and len(limited) == 92
    assert sim.stats()["max_in_flight"] <= 8
    assert all(elapsed < 1.2 for _, elapsed, _ in limited), "the 429 comes at once, not after a wait"
    assert not any(k.startswith("x-ratelimit") for _, _, h in limited for k in h), "no rate-limit headers"
    assert len(t.usage()) == 8
    # Slots are free again after completion...
    assert chat(t, max_tokens=5).status_code == 200
    # ...after an upstream error...
    assert chat(t, max_tokens=5, sim={"status": 400}).status_code == 400
    # ...and after a client disconnect.
    with pytest.raises(httpx.ReadTimeout):
        with t.http() as c:
            c.post("/v1/chat/completions", json={**body, "sim": {"delay_ms": 3000}}, timeout=0.3)
    deadline = time.monotonic() + 5
    while t.org()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.org()["in_flight"] == 0
    assert_ledger_matches_credits(t)


# -- per-minute limits with the movable clock -------------------------------------------------


def test_requests_per_minute(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key(rpm_limit=3)
    for _ in range(3):
        assert chat(t, max_tokens=3).status_code == 200
    r = chat(t, max_tokens=3)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    reset = int(r.headers["x-ratelimit-reset"])
    assert 0 < reset <= 60 and r.headers["retry-after"] == str(reset)
    assert r.headers["x-ratelimit-limit-requests"] == "3"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(t.usage()) == 3, "a 429 is not billed"
    advance(gw, 61)
    assert chat(t, max_tokens=3).status_code == 200


def test_tokens_per_minute(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key(tpm_limit=60)
    first = chat(t, max_tokens=30)
    used = first.json()["usage"]["total_tokens"]
    assert used < 60
    second = chat(t, max_tokens=30)
    assert second.status_code == 200
    r = chat(t, max_tokens=30)
    assert r.status_code == 429
    assert r.headers["x-ratelimit-limit-tokens"] == "60"
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(r.headers["retry-after"]) > 0
    state = t.http().get("/v1/key").json()["rate_limits"]
    assert state["tokens_per_minute"] == 60 and state["tokens_left"] == 0
    advance(gw, 61)
    assert chat(t, max_tokens=30).status_code == 200


def test_per_key_limits(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key(key_fields={"rpm_limit": 2})
    assert chat(t, max_tokens=3).status_code == 200
    assert chat(t, max_tokens=3).status_code == 200
    assert chat(t, max_tokens=3).status_code == 429
    other = gw.admin.post("/keys", json={"project_id": t.project_id}).json()["key"]
    with gw.http(other) as c:  # the organisation still has room
        r = c.post("/v1/chat/completions", json={"model": "qwen3-32b", "messages": MSG, "max_tokens": 3})
    assert r.status_code == 200
    advance(gw, 61)


# -- periods: the calendar month and key spend resets ------------------------------------------


def test_monthly_budget_starts_again_next_month(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key(monthly_budget="0.00003")
    while chat(t, max_tokens=20).status_code == 200:
        pass
    assert chat(t, max_tokens=20).json()["error"]["code"] == "budget_exceeded"
    advance(gw, 32 * 86400)
    assert chat(t, max_tokens=20).status_code == 200
    assert_ledger_matches_credits(t)


def test_key_spend_limit_with_daily_reset(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key(key_fields={"spend_limit": "0.00003", "spend_reset": "daily"})
    while chat(t, max_tokens=20).status_code == 200:
        pass
    info = t.http().get("/v1/key").json()
    assert info["spend_reset"] == "daily" and Decimal(info["spendable"]) < Decimal("0.00001")
    advance(gw, 86400)
    assert chat(t, max_tokens=20).status_code == 200
    info = t.http().get("/v1/key").json()
    assert Decimal(info["period_spend"]) < Decimal(info["spend"])


def test_key_info_reports_what_can_still_be_spent(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key(credits="5", monthly_budget="2", key_fields={"spend_limit": "1"})
    info = t.http().get("/v1/key").json()
    assert info["spendable"] == "1" and info["rate_limits"]["spendable_limited_by"] == "key"
    state = info["rate_limits"]
    assert state["requests_left"] == state["requests_per_minute"] and state["in_flight"] == 0
    chat(t, max_tokens=5)
    info = t.http().get("/v1/key").json()
    assert Decimal(info["spendable"]) == 1 - Decimal(info["spend"])
    assert info["rate_limits"]["requests_left"] == state["requests_per_minute"] - 1


# -- maintenance -------------------------------------------------------------------------------------


def test_maintenance_drains_streams_in_flight(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    t = gw.new_key()
    with t.http() as c, c.stream("POST", "/v1/chat/completions", json={
        "model": "qwen3-32b", "messages": MSG, "stream": True, "sim": {"reply_tokens": 30, "token_delay_ms": 30},
    }) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        until = advance(gw, 0) + 3600  # on the gateway's clock, which earlier tests moved
        assert gw.admin.put("/maintenance", json={"until": until}).status_code == 200
        try:
            refused = chat(t)
            assert refused.status_code == 503 and "retry-after" in refused.headers
            assert httpx.get(gw.url + "/health").json()["status"] == "maintenance"
            rest = [line for line in lines if line.startswith("data: ")]
        finally:
            gw.admin.put("/maintenance", json={"until": None})
    assert rest[-1] == "data: [DONE]", "a stream in flight finishes"
    assert len(t.usage()) == 1, "the drained stream is billed, the refused request is not"


# -- the same refusals in Anthropic's shape ----------------------------------------------------


def _messages(t: Tenant, **body: Any) -> httpx.Response:
    with t.http() as c:
        return c.post("/v1/messages?beta=true", headers={"anthropic-version": "2023-06-01"}, json={
            "model": "qwen3-32b", "max_tokens": 20, "messages": [{"role": "user", "content": "Hello"}], **body})


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert "x-neocloud-generation-id" not in r.headers
    return str(body["error"]["message"])


def test_refusals_on_messages_come_in_anthropic_shape(env: tuple[Gateway, Sim]) -> None:
    gw, _ = env
    for org_fields, key_fields, word in (({"credits": "0"}, {}, "credits"),
                                         ({"monthly_budget": "0"}, {}, "budget"),
                                         ({}, {"spend_limit": "0"}, "limit")):
        t = gw.new_key(**{"credits": "10", **org_fields}, key_fields=key_fields)
        assert word in _anthropic_error(_messages(t), 402, "billing_error").lower()
        assert t.usage() == []
    t = gw.new_key(rpm_limit=1)
    assert _messages(t).status_code == 200
    r = _messages(t)
    _anthropic_error(r, 429, "rate_limit_error")
    assert int(r.headers["retry-after"]) > 0 and "x-ratelimit-reset" in r.headers
    gw.admin.post(f"/keys/{t.key_id}/suspend")
    _anthropic_error(_messages(t), 403, "permission_error")
    t = gw.new_key()
    assert gw.admin.put("/maintenance", json={"until": advance(gw, 0) + 600}).status_code == 200
    try:
        r = _messages(t)
        _anthropic_error(r, 503, "overloaded_error")
        assert r.headers["retry-after"]
    finally:
        gw.admin.put("/maintenance", json={"until": None})
    assert len(t.usage()) == 0
    advance(gw, 61)

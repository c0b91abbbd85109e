"""POST /v1/messages/count_tokens: exact, converted like /v1/messages, never billed.

The simulator's /tokenize and its generation count tokens the same way, so
"exact" is checked as equality with the prompt tokens the same request is
billed for on /v1/messages.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from concurrent.futures import ThreadPoolExecutor

from conftest import Gateway, Sim, Tenant, catalog_toml, start_gateway, stop
from test_messages import QWEN, WEATHER, assert_anthropic_error, post, sdk

COUNT = "/v1/messages/count_tokens"


def conversation(text: str) -> dict[str, Any]:
    return {
        "model": QWEN,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=00000;"},
                   {"type": "text", "text": "You are a weather bot."}],
        "tools": [WEATHER],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": text},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
    }


def test_count_equals_the_prompt_tokens_of_the_same_messages_request(tenant: Tenant) -> None:
    body = conversation("Weather in Paris?")
    counted = post(tenant, body, path=COUNT)
    assert counted.status_code == 200, counted.text
    assert counted.json().keys() == {"input_tokens"}
    billed = post(tenant, {**body, "max_tokens": 300})
    assert billed.status_code == 200, billed.text
    [event] = tenant.usage()
    assert counted.json()["input_tokens"] == event["prompt_tokens"] > 0


def test_tools_system_and_thinking_count(tenant: Tenant) -> None:
    body = conversation("Weather in Oslo?")
    full = post(tenant, body, path=COUNT).json()["input_tokens"]
    no_tools = post(tenant, {k: v for k, v in body.items() if k != "tools"}, path=COUNT).json()["input_tokens"]
    no_system = post(tenant, {k: v for k, v in body.items() if k != "system"}, path=COUNT).json()["input_tokens"]
    assert full > no_tools and full > no_system


def test_with_the_sdk_and_claude_code_shapes(tenant: Tenant) -> None:
    client = sdk(tenant)
    small = client.messages.count_tokens(model=QWEN, messages=[{"role": "user", "content": "Hi"}])
    bigger = client.messages.count_tokens(model="claude-opus-5-5", tools=[WEATHER],
                                          messages=[{"role": "user", "content": "Hi"}])
    assert 0 < small.input_tokens < bigger.input_tokens
    beta = post(tenant, {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}], "context_management": {}},
                path=COUNT + "?beta=true", headers={"anthropic-beta": "token-counting-2024-11-01"})
    assert beta.json() == {"input_tokens": small.input_tokens}


def test_not_billed_and_no_generation_id(tenant: Tenant, sim: Sim) -> None:
    before = tenant.org()["credits"]
    resp = post(tenant, conversation("Count me."), path=COUNT)
    assert resp.status_code == 200
    assert "x-neocloud-generation-id" not in resp.headers
    assert tenant.usage() == [] and tenant.org()["credits"] == before
    assert all(e["path"] != "/v1/chat/completions" or "Count me." not in str(e["body"]) for e in sim.requests())


def test_errors_in_anthropic_shape(gateway: Gateway, tenant: Tenant) -> None:
    hello = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}]}
    with gateway.http() as anonymous:
        assert_anthropic_error(anonymous.post(COUNT, json=hello), 401, "authentication_error")
    assert_anthropic_error(post(tenant, {**hello, "model": "nope-1"}, path=COUNT), 404, "not_found_error")
    assert_anthropic_error(post(tenant, {**hello, "messages": []}, path=COUNT), 400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError):
        sdk(tenant).messages.count_tokens(model="nope-1", messages=hello["messages"])
    suspended = gateway.new_key()
    suspended.gw.admin.post(f"/keys/{suspended.key_id}/suspend")
    assert_anthropic_error(post(suspended, hello, path=COUNT), 403, "permission_error")


def test_takes_no_generation_slot_and_no_request_of_the_minute(gateway: Gateway) -> None:
    """Claude Code's /context fires a few dozen counts at once: none may be refused for the
    generation limits (8 in flight, requests per minute), and none may use them up."""
    tenant = gateway.new_key(rpm_limit=2, concurrency_limit=2)
    hello = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}]}
    with ThreadPoolExecutor(26) as pool:
        statuses = list(pool.map(lambda _: post(tenant, hello, path=COUNT).status_code, range(26)))
    assert statuses == [200] * 26
    assert post(tenant, {**hello, "max_tokens": 10}).status_code == 200
    assert post(tenant, {**hello, "max_tokens": 10}).status_code == 200
    assert_anthropic_error(post(tenant, {**hello, "max_tokens": 10}), 429, "rate_limit_error")
    assert post(tenant, hello, path=COUNT).status_code == 200  # its own window


def test_has_its_own_per_minute_limit(sim: Sim) -> None:
    gw = start_gateway(catalog_toml(sim.url).replace("[limits]", "[limits]\ncount_tokens_rpm = 3"),
                       env={"KILN_TEST_CLOCK": "1"})
    try:
        tenant = gw.new_key()
        hello = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}]}
        assert [post(tenant, hello, path=COUNT).status_code for _ in range(3)] == [200] * 3
        refused = post(tenant, hello, path=COUNT)
        assert_anthropic_error(refused, 429, "rate_limit_error")
        assert int(refused.headers["retry-after"]) >= 1
        assert post(tenant, {**hello, "max_tokens": 10}).status_code == 200  # generations unaffected
        gw.admin.post("/clock", json={"seconds": 61})
        assert post(tenant, hello, path=COUNT).status_code == 200
    finally:
        stop(gw.proc)


def test_estimate_only_when_no_backend_can_count(tenant: Tenant, gateway: Gateway) -> None:
    resp = post(tenant, {"model": "offline-model", "messages": [{"role": "user", "content": "Hello " * 30}]},
                path=COUNT)
    assert resp.status_code == 200 and resp.json()["input_tokens"] > 0
    assert "count_tokens for offline-model is an estimate" in gateway.log.read_text()

"""POST /v1/messages, JSON responses: the request mapping, the Message object, errors and metering.

The official `anthropic` SDK and raw httpx talk to the real gateway in front of
the real simulator. A Messages request has no room for the simulator's `sim`
control object, so tests drive the simulator with its `rules` setting: a
unique tag in the last user turn selects the behaviour (`script()`), and the
same tag finds the chat body the simulator received (`upstream()`).
"""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from typing import Any

import anthropic
import httpx
import pytest

from conftest import OSS, QWEN, WEATHER_ANTHROPIC as WEATHER, Gateway, Sim, Tenant, assert_recorded_at_no_cost

ALIAS = "claude-opus-5-5"  # an alias of qwen3-32b in conftest's catalog
MIB = 1024 * 1024


# -- helpers (shared by the other Messages test modules) ---------------------------------------


def script(sim: Sim, control: dict[str, Any] | None = None) -> str:
    """A fresh tag; requests whose last turn contains it behave as if they carried `control` as `sim`."""
    tag = "tag" + uuid.uuid4().hex[:16]
    sim.http.post("/sim/rules", json={"when": tag, "sim": control or {}}).raise_for_status()
    return tag


def upstream(sim: Sim, tag: str) -> dict[str, Any]:
    """The chat body the simulator received for the request carrying `tag`."""
    for entry in reversed(sim.requests()):
        if tag in json.dumps(entry["body"]):
            return entry["body"]
    raise AssertionError(f"no upstream request carried {tag}")


def sdk(tenant: Tenant, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tenant.gw.url, api_key=tenant.key, max_retries=0, **kw)


def post(tenant: Tenant, body: dict[str, Any], path: str = "/v1/messages", **kw: Any) -> httpx.Response:
    with tenant.http() as client:
        return client.post(path, json=body, **kw)


def ask(text: str, model: str = QWEN, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 256, "messages": [{"role": "user", "content": text}], **extra}


def assert_anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    if status < 500:  # the client's own mistake: nothing recorded
        assert "x-neocloud-generation-id" not in resp.headers
    return str(body["error"]["message"])


# -- the Message object ----------------------------------------------------------------------


def test_create_returns_a_message_with_usage_and_no_cost(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply": "Hello from Kiln."})
    resp = post(tenant, ask(f"Hi {tag}", model=ALIAS))
    assert resp.status_code == 200, resp.text
    msg = resp.json()
    assert msg["id"].startswith("msg_") and msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["model"] == ALIAS  # the name the client sent
    assert msg["content"] == [{"type": "text", "text": "Hello from Kiln."}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("end_turn", None)
    assert set(msg["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                 "cache_creation_input_tokens"}
    assert "cost" not in json.dumps(msg)
    [event] = tenant.usage()
    assert event["id"] == resp.headers["x-neocloud-generation-id"]
    assert (event["endpoint"], event["model"]) == ("messages", QWEN)
    assert event["prompt_tokens"] == msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"]
    assert event["completion_tokens"] == msg["usage"]["output_tokens"] == 4  # Hello| from| Kiln|.


def test_ids_are_unique_and_the_sdk_parses_the_message(tenant: Tenant, sim: Sim) -> None:
    client = sdk(tenant)
    tag = script(sim, {"reply": "Fine."})
    first = client.messages.create(model=QWEN, max_tokens=50, messages=[{"role": "user", "content": tag}])
    second = client.messages.create(model=QWEN, max_tokens=50, messages=[{"role": "user", "content": tag}])
    assert first.id != second.id
    assert first.content[0].type == "text" and first.content[0].text == "Fine."
    assert first.usage.output_tokens == second.usage.output_tokens == 2


def test_cache_reads_are_excluded_from_input_tokens(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply": "Ok."})
    body = ask("A long shared prefix. " * 40 + tag)
    post(tenant, body)
    resp = post(tenant, body)
    usage = resp.json()["usage"]
    [second] = [e for e in tenant.usage() if e["id"] == resp.headers["x-neocloud-generation-id"]]
    assert usage["cache_read_input_tokens"] == second["cached_tokens"] > 0
    assert usage["input_tokens"] == second["prompt_tokens"] - second["cached_tokens"]


def test_length_stop_is_max_tokens(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply_tokens": 50})
    msg = post(tenant, {**ask(tag), "max_tokens": 5}).json()
    assert (msg["stop_reason"], msg["usage"]["output_tokens"]) == ("max_tokens", 5)


@pytest.mark.parametrize("ignore", [False, True])
def test_stop_sequences_are_enforced(tenant: Tenant, sim: Sim, ignore: bool) -> None:
    tag = script(sim, {"reply": "One two STOP three four.", "ignore_stop": ignore})
    msg = post(tenant, {**ask(tag), "stop_sequences": ["STOP", "never"]}).json()
    assert msg["content"] == [{"type": "text", "text": "One two "}]
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "STOP")
    assert upstream(sim, tag)["stop"] == ["STOP", "never"]


# -- request mapping --------------------------------------------------------------------------


def test_system_blocks_without_the_billing_header_make_one_leading_system_message(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim)
    body = ask(tag, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cch=1a2b3;"},
        {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Answer in English."},
    ])
    body["messages"].append({"role": "system", "content": [{"type": "text", "text": "Env: linux."}]})
    assert post(tenant, body).status_code == 200
    messages = upstream(sim, tag)["messages"]
    assert messages[0] == {"role": "system", "content": "You are terse.\nAnswer in English.\nEnv: linux."}
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "billing" not in json.dumps(messages)


def test_late_system_messages_become_user_text_and_same_roles_merge(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim)
    body = ask("First question.", system="Be brief.")
    body["messages"] += [
        {"role": "assistant", "content": "First answer."},
        {"role": "system", "content": "Now answer in French."},
        {"role": "user", "content": [{"type": "text", "text": "Second"}, {"type": "text", "text": tag}]},
    ]
    assert post(tenant, body).status_code == 200
    assert upstream(sim, tag)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First question."},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": f"Now answer in French.\nSecond\n{tag}"},
    ]


def test_tool_history_maps_to_tool_calls_and_tool_messages(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply": "Sunny in both.", "tool_calls": []})
    body = ask("Weather in Paris and Oslo?", tools=[WEATHER])
    body["messages"] += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": "opaque"},
            {"type": "redacted_thinking", "data": "secret"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "functions.get_weather:0", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}},
        ]},
        {"role": "user", "content": [
            {"type": "text", "text": tag},
            {"type": "tool_result", "tool_use_id": "functions.get_weather:0", "content": "18C sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": "retry later"}]},
        ]},
    ]
    msg = post(tenant, body).json()
    assert msg["content"][0]["text"] == "Sunny in both."
    sent = upstream(sim, tag)
    assert sent["messages"] == [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "Two cities.", "reasoning_content": "Two cities.",
         "tool_calls": [
             {"id": "functions.get_weather:0", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
         ]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout\nretry later"},
        {"role": "user", "content": tag},
    ]
    assert sent["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {k: v for k, v in WEATHER["input_schema"].items() if k != "$schema"}}}]


def test_server_and_deferred_tools_are_dropped_with_their_tool_choice(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply": "No search here."})
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
             {"name": "Later", "description": "Deferred.", "input_schema": {"type": "object"}, "defer_loading": True}]
    body = ask(tag, tools=tools, tool_choice={"type": "tool", "name": "web_search"})
    assert post(tenant, body).json()["content"][0]["text"] == "No search here."
    sent = upstream(sim, tag)
    assert "tools" not in sent and "tool_choice" not in sent


def test_a_deferred_tool_is_sent_once_a_tool_search_loaded_it(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"tool_calls": []})
    body = ask("Find a tool.", tools=[{**WEATHER, "defer_loading": True}])
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "tool_reference", "tool_name": "get_weather"}]}, {"type": "text", "text": tag}]},
    ]
    assert post(tenant, body).status_code == 200
    sent = upstream(sim, tag)
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather"]
    assert sent["messages"][-2] == {"role": "tool", "tool_call_id": "t1", "content": "Tool loaded: get_weather"}


def test_images_and_documents(tenant: Tenant, sim: Sim) -> None:
    blocks = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
        {"type": "document", "title": "Notes",
         "source": {"type": "text", "media_type": "text/plain", "data": "Buy milk."}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
    ]
    tag = script(sim)
    body = {**ask(tag, model=OSS)}
    body["messages"][0]["content"] = [*blocks, {"type": "text", "text": tag}]
    assert post(tenant, body).status_code == 200
    parts = upstream(sim, tag)["messages"][-1]["content"]
    assert parts[0] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    assert parts[1] == {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}
    assert parts[2] == {"type": "text", "text": "Notes\nBuy milk."}
    assert "cannot read PDF input" in parts[3]["text"]
    tag = script(sim)
    body = ask(tag)  # qwen3-32b takes no images: a placeholder keeps the conversation going
    body["messages"][0]["content"] = [blocks[0], {"type": "text", "text": tag}]
    assert post(tenant, body).status_code == 200
    assert "does not accept image input" in upstream(sim, tag)["messages"][-1]["content"]


def test_prefill_continues_the_final_assistant_message(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim)
    body = ask(tag)
    body["messages"].append({"role": "assistant", "content": "Partial"})
    assert post(tenant, body).status_code == 200
    sent = upstream(sim, tag)
    assert (sent["continue_final_message"], sent["add_generation_prompt"]) == (True, False)


def test_sampling_fields_pass_and_unknown_fields_are_ignored(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim)
    body = ask(tag, temperature=0.2, top_p=0.9, top_k=40, metadata={"user_id": '{"session_id":"s"}'},
               context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
               output_config={"effort": "medium"}, service_tier="auto", safeguards=[{"type": "x"}],
               cache_control={"type": "ephemeral"}, brand_new_field={"a": 1})
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,effort-2025-11-24"}
    resp = post(tenant, body, path="/v1/messages?beta=true", headers=headers)
    assert resp.status_code == 200, resp.text
    sent = upstream(sim, tag)
    assert (sent["temperature"], sent["top_p"], sent["top_k"]) == (0.2, 0.9, 40)
    for name in ("metadata", "context_management", "output_config", "service_tier", "safeguards", "brand_new_field"):
        assert name not in sent


def test_max_tokens_is_required_and_clamped_to_what_the_model_allows(tenant: Tenant, sim: Sim) -> None:
    body = ask("Hello")
    del body["max_tokens"]
    assert "max_tokens" in assert_anthropic_error(post(tenant, body), 400, "invalid_request_error")
    tag = script(sim)
    assert post(tenant, {**ask(tag), "max_tokens": 128000}).status_code == 200
    assert upstream(sim, tag)["max_tokens"] == 8192  # qwen3-32b: max_output_tokens
    tag = script(sim)
    assert post(tenant, {**ask("word " * 17000 + tag), "max_tokens": 128000}).status_code == 200
    assert 1024 < upstream(sim, tag)["max_tokens"] < 8192  # what the context leaves, by estimate


# -- thinking and tools through the SDK ----------------------------------------------------


def test_thinking_maps_to_the_reasoning_switch_and_comes_back_signed(tenant: Tenant, sim: Sim) -> None:
    client = sdk(tenant)
    tag = script(sim, {"reasoning": "Let me think.", "reply": "Done."})
    msg = client.messages.create(model=QWEN, max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024},
                                 messages=[{"role": "user", "content": tag}])
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Let me think." and msg.content[0].signature
    assert upstream(sim, tag)["chat_template_kwargs"] == {"enable_thinking": True}
    tag = script(sim, {"reasoning": "Hidden.", "reply": "Done."})
    msg = client.messages.create(model=QWEN, max_tokens=200, messages=[{"role": "user", "content": tag}])
    assert [b.type for b in msg.content] == ["text"]  # not asked for: no thinking block
    assert upstream(sim, tag)["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("thinking, effort, expected", [
    ({"type": "adaptive"}, "max", "high"),
    ({"type": "enabled", "budget_tokens": 2048}, None, "low"),
    ({"type": "disabled"}, "high", "low"),
])
def test_gpt_oss_reasoning_effort(tenant: Tenant, sim: Sim, thinking: dict[str, Any], effort: str | None,
                                  expected: str) -> None:
    tag = script(sim)
    extra = {"output_config": {"effort": effort}} if effort else {}
    assert post(tenant, ask(tag, model=OSS, thinking=thinking, **extra)).status_code == 200
    sent = upstream(sim, tag)
    assert sent["reasoning_effort"] == expected and "chat_template_kwargs" not in sent


def test_tool_use_loop_with_the_sdk(tenant: Tenant, sim: Sim) -> None:
    client = sdk(tenant)
    tag = script(sim, {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]})
    messages: list[Any] = [{"role": "user", "content": f"Weather in Paris? {tag}"}]
    first = client.messages.create(model=QWEN, max_tokens=500, tools=[WEATHER], messages=messages)
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    done = script(sim, {"reply": "It is sunny in Paris."})
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": call.id, "content": f"sunny {done}"}]}]
    second = client.messages.create(model=QWEN, max_tokens=500, tools=[WEATHER], messages=messages)
    assert (second.stop_reason, second.content[0].text) == ("end_turn", "It is sunny in Paris.")
    assert upstream(sim, done)["messages"][-1] == {"role": "tool", "tool_call_id": call.id, "content": f"sunny {done}"}
    assert len(tenant.usage()) == 2


@pytest.mark.parametrize("model, told", [(OSS, True), (QWEN, False)])
def test_disable_parallel_tool_use(tenant: Tenant, sim: Sim, model: str, told: bool) -> None:
    calls = [{"name": "get_weather", "arguments": {"city": city}} for city in ("Paris", "Oslo")]
    tag = script(sim, {"tool_calls": calls})
    body = ask(tag, model=model, tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    msg = post(tenant, body).json()
    assert [b["input"] for b in msg["content"] if b["type"] == "tool_use"] == [{"city": "Paris"}]
    assert ("parallel_tool_calls" in upstream(sim, tag)) == told


def test_forced_tool_choice(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim)
    msg = post(tenant, ask(tag, model=OSS, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})).json()
    assert msg["stop_reason"] == "tool_use"  # vLLM says "stop" for a named choice; tool calls decide
    assert upstream(sim, tag)["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    tag = script(sim)
    assert post(tenant, ask(tag, model=OSS, tools=[WEATHER], tool_choice={"type": "any"})).status_code == 200
    assert upstream(sim, tag)["tool_choice"] == "required"
    resp = post(tenant, ask("Hi", tools=[WEATHER], tool_choice={"type": "any"}))
    assert "forced tool choice" in assert_anthropic_error(resp, 400, "invalid_request_error")


# -- errors in Anthropic's shape --------------------------------------------------------------


def test_authentication_with_x_api_key_or_bearer(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply": "ok"})
    with httpx.Client(base_url=tenant.gw.url, timeout=30) as raw:
        assert raw.post("/v1/messages", json=ask(tag), headers={"x-api-key": tenant.key}).status_code == 200
        bearer = {"Authorization": f"Bearer {tenant.key}"}
        assert raw.post("/v1/messages", json=ask(tag), headers=bearer).status_code == 200
        resp = raw.post("/v1/messages", json=ask(tag))
        assert_anthropic_error(resp, 401, "authentication_error")
        resp = raw.post("/v1/messages", json=ask(tag), headers={"x-api-key": "sk-kiln-wrong"})
        assert_anthropic_error(resp, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=tenant.gw.url, api_key="sk-kiln-wrong", max_retries=0).messages.create(
            model=QWEN, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert len(tenant.usage()) == 2


def test_gateway_errors_have_anthropic_types_and_sdk_classes(gateway: Gateway) -> None:
    hello = {"model": QWEN, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    broke = gateway.new_key(credits="0")
    assert_anthropic_error(post(broke, hello), 402, "billing_error")
    with pytest.raises(anthropic.PaymentRequiredError):
        sdk(broke).messages.create(**hello)
    suspended = gateway.new_key()
    assert suspended.gw.admin.post(f"/keys/{suspended.key_id}/suspend").status_code == 200
    assert_anthropic_error(post(suspended, hello), 403, "permission_error")
    with pytest.raises(anthropic.PermissionDeniedError):
        sdk(suspended).messages.create(**hello)
    tenant = gateway.new_key()
    message = assert_anthropic_error(post(tenant, {**hello, "model": "claude-unknown-9"}), 404, "not_found_error")
    assert "claude-unknown-9" in message
    with pytest.raises(anthropic.NotFoundError):
        sdk(tenant).messages.create(**{**hello, "model": "claude-unknown-9"})
    big = {**hello, "messages": [{"role": "user", "content": "x" * (9 * MIB)}]}
    assert_anthropic_error(post(tenant, big), 413, "request_too_large")
    with pytest.raises(anthropic.BadRequestError):
        sdk(tenant).messages.create(**{**hello, "messages": []})
    assert tenant.usage() == []


def test_rate_limits_are_rate_limit_error(gateway: Gateway, sim: Sim) -> None:
    tenant = gateway.new_key(concurrency_limit=1)
    slow = {**ask(script(sim, {"ttft_ms": 1500})), "stream": True}
    with tenant.http() as client, client.stream("POST", "/v1/messages", json=slow) as running:
        assert running.status_code == 200
        assert_anthropic_error(post(tenant, ask("hi")), 429, "rate_limit_error")
        with pytest.raises(anthropic.RateLimitError):
            sdk(tenant).messages.create(**ask("hi"))
        running.read()
    limited = gateway.new_key(rpm_limit=1)
    assert post(limited, ask("hi")).status_code == 200
    resp = post(limited, ask("hi"))
    assert_anthropic_error(resp, 429, "rate_limit_error")
    assert int(resp.headers["retry-after"]) >= 1


@pytest.mark.parametrize("status, kind, exc", [
    (500, "api_error", anthropic.InternalServerError),
    (503, "overloaded_error", anthropic.ServiceUnavailableError),
])
def test_upstream_failures_are_json_not_plain_text(tenant: Tenant, sim: Sim, status: int, kind: str,
                                                   exc: type[Exception]) -> None:
    tag = script(sim, {"status": status})
    resp = post(tenant, ask(tag))
    assert_anthropic_error(resp, 502 if status == 500 else 503, kind)
    assert_recorded_at_no_cost(tenant, resp)
    with pytest.raises(exc):
        sdk(tenant).messages.create(**ask(tag))
    assert [Decimal(e["cost"]) for e in tenant.usage()] == [0, 0]


def test_offline_backend_is_an_anthropic_error(tenant: Tenant) -> None:
    resp = post(tenant, ask("hi", model="offline-model"))
    assert resp.status_code in (502, 503)
    assert resp.json()["error"]["type"] in ("api_error", "overloaded_error")


def test_context_overflow_is_prompt_is_too_long(tenant: Tenant) -> None:
    resp = post(tenant, ask("word " * 40_000))  # the simulator's context is 32768 tokens
    message = assert_anthropic_error(resp, 400, "invalid_request_error")
    assert message.startswith("prompt is too long: 4000") and message.endswith(" tokens > 32768 maximum")
    with pytest.raises(anthropic.BadRequestError) as exc:
        sdk(tenant).messages.create(**{**ask("word " * 40_000), "stream": True})
    assert "prompt is too long" in str(exc.value)
    assert tenant.usage() == []


def test_estimate_miss_on_an_older_backend_asks_for_a_smaller_max_tokens(tenant: Tenant, sim: Sim) -> None:
    # The simulator as vLLM <= 0.16: prompt + max_tokens over the context is a 400.
    tag = script(sim, {"legacy_length_check": True})
    # One simulator token per character here, so the byte estimate leaves too much room.
    message = assert_anthropic_error(post(tenant, {**ask("." * 30_000 + " " + tag), "max_tokens": 8192}), 400,
                                     "invalid_request_error")
    assert message.startswith("input length and `max_tokens` exceed context limit: 300")
    assert " + 8192 > 32768, decrease input length or `max_tokens` and try again" in message


# -- metering: the same as chat completions ------------------------------------------------


@pytest.mark.parametrize("thinking", [False, True])
def test_same_prompt_same_tokens_and_cost_as_chat(tenant: Tenant, thinking: bool) -> None:
    text = f"Tell me something {uuid.uuid4().hex}"
    chat_body: dict[str, Any] = {"model": QWEN, "max_tokens": 300, "messages": [{"role": "user", "content": text}]}
    if not thinking:
        chat_body["chat_template_kwargs"] = {"enable_thinking": False}
    chat = post(tenant, chat_body, path="/v1/chat/completions")
    extra = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}
    messages = post(tenant, {**ask(text), "max_tokens": 300, **extra})
    assert chat.status_code == messages.status_code == 200
    events = {e["id"]: e for e in tenant.usage()}
    assert len(events) == 2
    a, b = events[chat.headers["x-neocloud-generation-id"]], events[messages.headers["x-neocloud-generation-id"]]
    fields = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "cost")
    assert [a[f] for f in fields] == [b[f] for f in fields]
    assert (a["endpoint"], b["endpoint"]) == ("chat.completions", "messages")
    assert json.loads(chat.text, parse_float=Decimal)["usage"]["cost"] == Decimal(b["cost"]) > 0
    assert (b["reasoning_tokens"] > 0) == thinking


def test_unknown_paths_and_methods_under_messages_are_anthropic_errors(tenant: Tenant) -> None:
    with tenant.http() as c:
        missing = c.post("/v1/messages/batches", json={})
        wrong = c.get("/v1/messages/count_tokens")
        get_messages = c.get("/v1/messages")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert wrong.status_code == 405 and wrong.json()["type"] == "error"
    assert get_messages.status_code == 405 and get_messages.json()["type"] == "error"

"""POST /v1/responses (stateless) as JSON: request mapping, the response object, tools, reasoning, errors.

The official SDK is the client; what the backend received is read back from
the simulator (`GET /sim/requests`) by a unique `sim.tag` per request. The
streaming contract is in test_responses_stream.py.
"""

from __future__ import annotations

import json
import uuid
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest

from conftest import OSS, QWEN, QWEN_UPSTREAM, WEATHER_RESPONSES as WEATHER, Sim, Tenant, catalog_cost

PATCH_GRAMMAR = 'start: "*** Begin Patch" LF hunk+ "*** End Patch"'
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"


def tag_sim(**sim: Any) -> tuple[dict[str, Any], str]:
    tag = uuid.uuid4().hex
    return {"sim": {**sim, "tag": tag}}, tag


def upstream(sim: Sim, tag: str) -> dict[str, Any] | None:
    found = sim.tagged(tag)
    if found is None:
        return None
    assert found[0] == "/v1/chat/completions"
    return found[1]


def create(tenant: Tenant, **kw: Any) -> Any:
    return tenant.openai().responses.create(**kw)


def post(tenant: Tenant, body: dict[str, Any]) -> httpx.Response:
    with tenant.http() as client:
        return client.post("/v1/responses", json=body)


# -- the response object ----------------------------------------------------------------------


def test_text_response_object_usage_and_ledger(tenant: Tenant, sim: Sim) -> None:
    extra, tag = tag_sim()
    raw = tenant.openai().responses.with_raw_response.create(model=QWEN, input="Hello!", extra_body=extra)
    r = raw.parse()
    assert r.id.startswith("resp_") and r.object == "response" and r.model == QWEN and r.status == "completed"
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output_text and r.output[1].role == "assistant" and r.output[1].content[0].type == "output_text"
    assert r.output[0].content[0].text and r.output[0].encrypted_content is None  # not asked for
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens > 0
    sent = upstream(sim, tag)
    assert sent is not None and sent["model"] == QWEN_UPSTREAM
    assert sent["messages"] == [{"role": "user", "content": "Hello!"}] and sent["stream"] is False
    ev = {e["id"]: e for e in tenant.usage()}[raw.headers["x-neocloud-generation-id"]]
    assert ev["endpoint"] == "responses"
    assert (ev["prompt_tokens"], ev["completion_tokens"]) == (u.input_tokens, u.output_tokens)
    # The JSON body is OpenAI-shaped: usage.cost as deducted (only the stream events omit it).
    shown = Decimal(json.loads(raw.http_response.text, parse_float=Decimal)["usage"]["cost"])
    cached = u.input_tokens_details.cached_tokens
    assert Decimal(ev["cost"]) == shown == catalog_cost(QWEN, u.input_tokens, cached, u.output_tokens)


def test_input_items_become_chat_messages(tenant: Tenant, sim: Sim) -> None:
    """Leading system/developer merge into one system message; a late one becomes a user message."""
    extra, tag = tag_sim(reply="ok")
    create(tenant, model=QWEN, instructions="Be brief.", extra_body=extra, input=[
        {"role": "developer", "content": "You are a coding agent."},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "id": "msg_1", "role": "user", "content": [
            {"type": "input_text", "text": "Line one."}, {"type": "input_text", "text": "Line two."}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Earlier answer.", "annotations": []}]},
        {"role": "developer", "content": "<permissions>workspace-write</permissions>"},
        {"role": "user", "content": "Go on."},
    ])
    assert upstream(sim, tag)["messages"] == [  # type: ignore[index]
        {"role": "system", "content": "Be brief.\n\nYou are a coding agent.\n\nUse tools."},
        {"role": "user", "content": "Line one.\nLine two."},
        {"role": "assistant", "content": "Earlier answer."},
        {"role": "user", "content": "<permissions>workspace-write</permissions>"},
        {"role": "user", "content": "Go on."},
    ]


# -- tools ------------------------------------------------------------------------------------


def test_function_tool_call_and_output_round_trip(tenant: Tenant, sim: Sim) -> None:
    extra, tag = tag_sim(tool_calls=[{"name": "get_weather", "arguments": {"city": "Paris"}}])
    first = create(tenant, model=QWEN, input="Weather in Paris?", tools=[WEATHER], extra_body=extra)
    sent = upstream(sim, tag)
    assert sent["tools"] == [{"type": "function", "function": {  # type: ignore[index]
        "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["parameters"]}}]
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")
    reasoning = next(item for item in first.output if item.type == "reasoning")

    extra, tag = tag_sim(reply="It is sunny.")
    history = [{"role": "user", "content": "Weather in Paris?"},
               *[i.model_dump(exclude_none=True) for i in first.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = create(tenant, model=QWEN, input=history, tools=[WEATHER], extra_body=extra)
    assert second.output_text == "It is sunny."
    messages = upstream(sim, tag)["messages"]  # type: ignore[index]
    assert messages[1:] == [
        {"role": "assistant", "content": None, "reasoning": reasoning.content[0].text,
         "reasoning_content": reasoning.content[0].text,
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]


def test_custom_tool_is_a_one_string_function_upstream_and_a_custom_tool_call_back(tenant: Tenant, sim: Sim) -> None:
    extra, tag = tag_sim(tool_calls=[{"name": "apply_patch", "arguments": {"input": PATCH}}])
    r = create(tenant, model=QWEN, input="Add a.txt", tools=[APPLY_PATCH], extra_body=extra)
    fn = upstream(sim, tag)["tools"][0]["function"]  # type: ignore[index]
    assert fn["name"] == "apply_patch" and fn["parameters"]["required"] == ["input"]
    assert PATCH_GRAMMAR in fn["parameters"]["properties"]["input"]["description"]
    call = next(item for item in r.output if item.type == "custom_tool_call")
    assert (call.name, call.input) == ("apply_patch", PATCH) and call.call_id

    extra, tag = tag_sim(reply="Done.")
    create(tenant, model=QWEN, tools=[APPLY_PATCH], extra_body=extra, input=[
        {"role": "user", "content": "Add a.txt"},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": call.call_id, "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "id": "ctco_1", "call_id": call.call_id, "output": "Success."},
    ])
    messages = upstream(sim, tag)["messages"]  # type: ignore[index]
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"input": PATCH}
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "Success."}


def test_tools_only_openai_can_run_are_dropped(tenant: Tenant, sim: Sim) -> None:
    codex_extras = [
        {"type": "web_search", "external_web_access": False, "search_content_types": ["text", "image"]},
        {"type": "tool_search", "execution": "client", "description": "Find tools.", "parameters": {}},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
    ]
    extra, tag = tag_sim(reply="ok")
    assert post(tenant, {"model": QWEN, "input": "hi", "tools": [*codex_extras, WEATHER], **extra}).status_code == 200
    assert [t["function"]["name"] for t in upstream(sim, tag)["tools"]] == ["get_weather"]  # type: ignore[index]
    extra, tag = tag_sim(reply="ok")
    r = post(tenant, {"model": QWEN, "input": "hi", "tools": codex_extras, "tool_choice": "auto", **extra})
    assert r.status_code == 200, r.text
    sent = upstream(sim, tag)
    assert "tools" not in sent and "tool_choice" not in sent  # type: ignore[operator]


AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.", "tools": [
    {**WEATHER, "name": "spawn_agent", "description": "Start an agent."}, {"type": "web_search"}]}


def test_namespace_tools_are_offered_flattened_and_called_back_under_their_own_names(tenant: Tenant,
                                                                                     sim: Sim) -> None:
    """Codex's namespace tools (multi_agent_v1): each function reaches the model with the namespace
    in its name, and a call comes back as a function_call of that namespace."""
    flat = "multi_agent_v1__spawn_agent"
    extra, tag = tag_sim(tool_calls=[{"name": flat, "arguments": {"city": "Paris"}}])
    r = create(tenant, model=QWEN, input="start one", tools=[AGENTS, WEATHER], extra_body=extra)
    sent = upstream(sim, tag)
    assert [t["function"]["name"] for t in sent["tools"]] == [flat, "get_weather"]  # type: ignore[index]
    [call] = [i for i in r.output if i.type == "function_call"]
    assert (call.name, getattr(call, "namespace", None)) == ("spawn_agent", "multi_agent_v1")
    history = [{"type": "message", "role": "user", "content": "start one"},
               {"type": "function_call", "call_id": call.call_id, "name": "spawn_agent",
                "namespace": "multi_agent_v1", "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "started"}]
    extra, tag = tag_sim(reply="ok")
    create(tenant, model=QWEN, input=history, tools=[AGENTS], extra_body=extra)
    assistant = upstream(sim, tag)["messages"][1]  # type: ignore[index]
    assert assistant["tool_calls"][0]["function"]["name"] == flat
    extra, tag = tag_sim(tool_calls=[{"name": flat, "arguments": {"city": "Oslo"}}])
    events = [e for e in tenant.openai().responses.create(model=QWEN, input="again", tools=[AGENTS], stream=True,
                                                          extra_body=extra)]
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type != "reasoning"]
    assert [(i.type, i.name) for i in done] == [("function_call", "spawn_agent")]
    assert [i.name for i in events[-1].response.output if i.type == "function_call"] == ["spawn_agent"]


def test_parallel_tool_calls_false_keeps_one_call_on_a_model_that_cannot_be_told(tenant: Tenant, sim: Sim) -> None:
    calls = [{"name": "get_weather", "arguments": {"city": city}} for city in ("Paris", "Oslo")]
    extra, tag = tag_sim(tool_calls=calls)
    r = create(tenant, model=QWEN, input="both", tools=[WEATHER], parallel_tool_calls=False, extra_body=extra)
    assert [json.loads(i.arguments)["city"] for i in r.output if i.type == "function_call"] == ["Paris"]
    assert "parallel_tool_calls" not in upstream(sim, tag)  # type: ignore[operator]


# -- reasoning round trip --------------------------------------------------------------------


def reasoning_history(item: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Think first."}, item,
            {"role": "assistant", "content": "Answer."}, {"role": "user", "content": "And then?"}]


def test_encrypted_reasoning_is_restored_on_the_next_turn(tenant: Tenant, sim: Sim) -> None:
    r = create(tenant, model=QWEN, input="Think first.", include=["reasoning.encrypted_content"],
               extra_body={"sim": {"reasoning": "The user wants a plan. Step one."}})
    item = next(i for i in r.output if i.type == "reasoning")
    assert item.encrypted_content and item.encrypted_content.startswith("kiln-rs1.")
    blob_only = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
    extra, tag = tag_sim(reply="Then step two.")
    create(tenant, model=QWEN, input=reasoning_history(blob_only), extra_body=extra)
    assistant = upstream(sim, tag)["messages"][1]  # type: ignore[index]
    assert assistant["reasoning"] == assistant["reasoning_content"] == "The user wants a plan. Step one."


@pytest.mark.parametrize(
    "blob", ["tampered", "gAAAAABo-openai-encrypted-blob==", "kiln-rs1.!!!not-base64", "kiln-rs1."],
    ids=["tampered", "foreign", "garbage", "empty"],
)
def test_forged_or_foreign_reasoning_blobs_are_ignored(tenant: Tenant, sim: Sim, blob: str) -> None:
    if blob == "tampered":
        r = create(tenant, model=QWEN, input="x", include=["reasoning.encrypted_content"])
        good = next(i for i in r.output if i.type == "reasoning").encrypted_content
        blob = good[:-6] + ("AAAAAA" if not good.endswith("AAAAAA") else "BBBBBB")
    extra, tag = tag_sim(reply="ok")
    r = create(tenant, model=QWEN, extra_body=extra,
               input=reasoning_history({"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": blob}))
    assert r.status == "completed"
    assistant = upstream(sim, tag)["messages"][1]  # type: ignore[index]
    assert assistant == {"role": "assistant", "content": "Answer."}


def test_reasoning_text_from_content_or_summary_when_there_is_no_blob(tenant: Tenant, sim: Sim) -> None:
    extra, tag = tag_sim(reply="ok")
    create(tenant, model=QWEN, extra_body=extra, input=reasoning_history(
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "A summary."}],
         "content": None, "encrypted_content": None}))
    assert upstream(sim, tag)["messages"][1]["reasoning"] == "A summary."  # type: ignore[index]


def test_reasoning_effort_maps_per_model_family(tenant: Tenant, sim: Sim) -> None:
    extra, tag = tag_sim(reply="ok")
    create(tenant, model=OSS, input="hi", reasoning={"effort": "xhigh"}, extra_body=extra)
    assert upstream(sim, tag)["reasoning_effort"] == "high"  # type: ignore[index]
    extra, tag = tag_sim(reply="ok")
    r = create(tenant, model=QWEN, input="hi", reasoning={"effort": "none"}, extra_body=extra)
    assert upstream(sim, tag)["chat_template_kwargs"] == {"enable_thinking": False}  # type: ignore[index]
    assert [i.type for i in r.output] == ["message"]


# -- other request fields ---------------------------------------------------------------------


def test_max_output_tokens_becomes_max_tokens_and_an_incomplete_response(tenant: Tenant, sim: Sim) -> None:
    extra, tag = tag_sim(reasoning="", reply_tokens=30)
    r = create(tenant, model=QWEN, input="Write a lot.", max_output_tokens=5, extra_body=extra)
    assert upstream(sim, tag)["max_tokens"] == 5  # type: ignore[index]
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.max_output_tokens == 5


def test_codex_request_fields_are_accepted(tenant: Tenant, sim: Sim) -> None:
    """The body keys Codex CLI 0.171 sends, none of which a chat backend understands."""
    extra, tag = tag_sim(reply="ok")
    r = post(tenant, {
        "model": QWEN,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [WEATHER, APPLY_PATCH], "tool_choice": "auto", "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199-session", "text": {"verbosity": "low"}, "service_tier": "auto",
        "client_metadata": {"session_id": "s", "x-codex-turn-metadata": "{}"}, "metadata": {"k": "v"}, **extra,
    })
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["store"] is False
    sent = upstream(sim, tag)
    for dropped in ("include", "store", "prompt_cache_key", "text", "client_metadata", "reasoning", "metadata"):
        assert dropped not in sent, dropped  # type: ignore[operator]


def test_text_format_needs_a_model_with_structured_output(tenant: Tenant, sim: Sim) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}}
    r = post(tenant, {"model": QWEN, "input": "hi", "text": fmt})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    extra, tag = tag_sim(reply="{}")
    assert post(tenant, {"model": OSS, "input": "hi", "text": fmt, **extra}).status_code == 200
    assert upstream(sim, tag)["response_format"] == {  # type: ignore[index]
        "type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}}


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "unsupported_parameter"),
        ({"store": True}, "store", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "unsupported_parameter"),
        ({"input": []}, "input", "empty_array"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", None),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]},
         "input[0].content[0]", "unsupported_content"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
         "input[0].content", "unsupported_content"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools[0].description", None),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", None),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"stream": "sometimes"}, "stream", None),
    ],
    ids=["previous-response-id", "store-true", "conversation", "item-reference", "empty-input", "bad-role",
         "image-on-text-model", "input-file", "tool-without-description", "forced-tool-choice", "unknown-tool-choice",
         "zero-max-output-tokens", "bad-stream"],
)
def test_invalid_requests_are_400_and_never_reach_the_backend(
    tenant: Tenant, sim: Sim, body: dict[str, Any], param: str, code: str | None
) -> None:
    extra, tag = tag_sim()
    r = post(tenant, {"model": QWEN, "input": "hi", **body, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    if param in ("previous_response_id", "store"):
        assert "stateless" in error["message"]
    assert upstream(sim, tag) is None and not tenant.usage()


def test_sdk_errors(tenant: Tenant) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        create(tenant, model="no-such-model", input="hi")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        create(tenant, model=QWEN, input="hi", previous_response_id="resp_1")
    assert "stateless" in str(bad.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tenant.gw.url + "/v1", api_key="sk-wrong", max_retries=0).responses.create(
            model=QWEN, input="hi")


def test_context_overflow_without_streaming_is_a_400(tenant: Tenant) -> None:
    r = post(tenant, {"model": QWEN, "input": " word" * 40_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_backend_failure_is_a_plain_text_502(tenant: Tenant) -> None:
    extra, _ = tag_sim(status=500)
    r = post(tenant, {"model": QWEN, "input": "hi", **extra})
    assert r.status_code == 502 and r.headers["content-type"].startswith("text/plain")


# -- metering and the catalog -----------------------------------------------------------------


def test_same_prompt_through_chat_completions_and_responses_costs_the_same(tenant: Tenant) -> None:
    sim = {"reply": "Hi there, friend.", "reasoning": ""}
    client = tenant.openai()
    chat = client.chat.completions.with_raw_response.create(
        model=QWEN, messages=[{"role": "user", "content": "Hello!"}], extra_body={"sim": sim})
    responses = client.responses.with_raw_response.create(model=QWEN, input="Hello!", extra_body={"sim": sim})
    rendered = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"  # the simulator's chat template
    completion = client.completions.with_raw_response.create(model=QWEN, prompt=rendered, max_tokens=50,
                                                             extra_body={"sim": sim})
    events = {e["id"]: e for e in tenant.usage()}
    picked = [events[r.headers["x-neocloud-generation-id"]] for r in (chat, responses, completion)]
    assert [e["endpoint"] for e in picked] == ["chat.completions", "responses", "completions"]
    # (The prompt is shorter than one 16-token prefix-cache block, so nothing is billed as cached.)
    assert len({(e["prompt_tokens"], e["cached_tokens"], e["completion_tokens"], e["cost"]) for e in picked}) == 1, \
        picked
    e = picked[0]
    assert Decimal(e["cost"]) == catalog_cost(QWEN, e["prompt_tokens"], 0, e["completion_tokens"]) > 0


def test_models_list_carries_codex_metadata_beside_the_openai_list(tenant: Tenant) -> None:
    with tenant.http() as client:
        body = client.get("/v1/models").json()
    assert body["object"] == "list" and {m["id"] for m in body["data"]} >= {QWEN, OSS, "gpt-5"}
    codex = {m["slug"]: m for m in body["models"]}
    assert codex.keys() == {m["id"] for m in body["data"]}
    qwen = codex[QWEN]
    assert qwen["context_window"] == 32768 and qwen["apply_patch_tool_type"] == "freeform"
    assert [lvl["effort"] for lvl in qwen["supported_reasoning_levels"]] == ["low", "medium", "high"]
    assert codex["gpt-5"]["context_window"] == 131072 and codex["gpt-5"]["supports_parallel_tool_calls"] is True

"""POST /v1/responses with stream: true — the typed-event contract Codex CLI and the SDK rely on.

httpx reads the raw stream (event/data framing, sequence numbers, item order,
keepalives, failures); the official SDK's `responses.stream()` helper checks
that a client can assemble it. Failures are injected through the
simulator's per-request `sim` object.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from conftest import OSS, QWEN, WEATHER_RESPONSES as WEATHER, Gateway, Sim, Tenant

APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
FINAL = ("response.completed", "response.incomplete", "response.failed")


@dataclass
class Stream:
    status: int
    headers: httpx.Headers
    raw: str

    @property
    def frames(self) -> list[str]:
        return [f for f in self.raw.split("\n\n") if f]

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event; each frame must be `event: <type>` + `data: <json>` with the same type."""
        out = []
        for frame in self.frames:
            head, _, data = frame.partition("\n")
            assert head.startswith("event: ") and data.startswith("data: "), frame
            event = json.loads(data[len("data: "):])
            assert event["type"] == head[len("event: "):]
            out.append(event)
        return out

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    def text(self) -> str:
        return "".join(e["delta"] for e in self.of("response.output_text.delta"))


def stream(tenant: Tenant, body: dict[str, Any], **sim: Any) -> Stream:
    body = {"model": QWEN, "input": "Hello!", "stream": True, **body, "sim": {**sim, "tag": uuid.uuid4().hex}}
    with tenant.http() as client, client.stream("POST", "/v1/responses", json=body) as r:
        raw = r.read().decode()
    return Stream(r.status_code, r.headers, raw)


def check_grammar(s: Stream) -> dict[str, Any]:
    """The rules of protocols.md 5.7; returns the final response object."""
    assert s.status == 200 and s.headers["content-type"].startswith("text/event-stream"), s.raw
    events = s.events
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[-1]["type"] in FINAL and sum(e["type"] in FINAL for e in events) == 1
    assert "[DONE]" not in s.raw
    added: dict[int, str] = {}
    open_index: int | None = None
    for e in events:
        if e["type"] == "response.output_item.added":
            assert open_index is None, "one item at a time"
            assert e["output_index"] == len(added), "output indexes are contiguous"
            open_index = e["output_index"]
            added[open_index] = e["item"]["id"]
        elif e["type"] == "response.output_item.done":
            assert e["output_index"] == open_index and e["item"]["id"] == added[open_index]
            open_index = None
        elif "output_index" in e:
            assert e["output_index"] == open_index, f"{e['type']} outside its item"
            assert e.get("item_id", added[open_index]) == added[open_index]
    assert open_index is None or events[-1]["type"] == "response.failed", "items close with output_item.done"
    final = events[-1]["response"]
    ids = {e["response"]["id"] for e in events if "response" in e}
    assert len(ids) == 1 and final["id"].startswith("resp_")
    assert final["output"] == [e["item"] for e in s.of("response.output_item.done")]
    return final


# -- the event stream -------------------------------------------------------------------------


def test_text_stream_grammar_usage_and_ledger(tenant: Tenant) -> None:
    s = stream(tenant, {}, reasoning="Let me think.", reply="Hello to you too.")
    final = check_grammar(s)
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert s.text() == "Hello to you too." == final["output"][1]["content"][0]["text"]
    assert "".join(e["delta"] for e in s.of("response.reasoning_text.delta")) == "Let me think."
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    usage = final["usage"]
    assert "cost" not in usage
    assert all(isinstance(usage[k], int) for k in ("input_tokens", "output_tokens", "total_tokens"))
    [event] = tenant.usage()
    assert event["id"] == s.headers["x-neocloud-generation-id"] and event["endpoint"] == "responses"
    assert (event["prompt_tokens"], event["completion_tokens"]) == (usage["input_tokens"], usage["output_tokens"])
    assert usage["output_tokens_details"]["reasoning_tokens"] == event["reasoning_tokens"] > 0


def test_text_that_needs_escaping_is_the_same_in_every_event_and_the_json_answer(tenant: Tenant) -> None:
    """The closing events are written from the deltas' JSON string bodies, not re-encoded: a text
    with quotes, backslashes, control characters and non-ASCII comes out the same everywhere."""
    reply = 'Say "hi" \\ to C:\\temp\n\ttabs, caf\u00e9, \u65e5\u672c, \U0001f600 and \u2028 end.'
    s = stream(tenant, {}, reply=reply)
    final = check_grammar(s)
    [done] = s.of("response.output_text.done")
    [part] = [e["part"] for e in s.of("response.content_part.done") if e["part"]["type"] == "output_text"]
    [message] = [item for item in final["output"] if item["type"] == "message"]
    assert s.text() == reply == done["text"] == part["text"] == message["content"][0]["text"]
    assert message["content"] == [part]
    body = {"model": QWEN, "input": "Hello!", "sim": {"reply": reply, "tag": uuid.uuid4().hex}}
    with tenant.http() as client:
        answer = client.post("/v1/responses", json=body).json()
    [json_message] = [item for item in answer["output"] if item["type"] == "message"]
    assert {**json_message, "id": ""} == {**message, "id": ""}


def test_function_and_custom_tool_calls_stream_as_items(tenant: Tenant) -> None:
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}},
             {"name": "apply_patch", "arguments": {"input": PATCH}}]
    s = stream(tenant, {"tools": [WEATHER, APPLY_PATCH], "model": OSS}, tool_calls=calls, reasoning="")
    final = check_grammar(s)
    fn, custom = final["output"]
    assert fn["type"] == "function_call" and json.loads(fn["arguments"]) == {"city": "Paris"}
    assert "".join(e["delta"] for e in s.of("response.function_call_arguments.delta")) == fn["arguments"]
    [args_done] = s.of("response.function_call_arguments.done")
    assert (args_done["name"], args_done["arguments"]) == ("get_weather", fn["arguments"])
    assert custom["type"] == "custom_tool_call" and (custom["name"], custom["input"]) == ("apply_patch", PATCH)
    assert s.of("response.custom_tool_call_input.done")[0]["input"] == PATCH
    assert fn["call_id"] != custom["call_id"]


def test_reasoning_summary_and_encrypted_content_when_asked(tenant: Tenant) -> None:
    asked = {"reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"]}
    s = stream(tenant, asked, reasoning="Step one.", reply="ok")
    item = check_grammar(s)["output"][0]
    assert item["summary"] == [{"type": "summary_text", "text": "Step one."}]
    assert item["encrypted_content"].startswith("kiln-rs1.")
    summary = s.of("response.reasoning_summary_text.delta")
    assert "".join(e["delta"] for e in summary) == "Step one." and {e["summary_index"] for e in summary} == {0}
    assert s.of("response.output_item.added")[0]["item"]["encrypted_content"] is None


def test_max_output_tokens_ends_with_response_incomplete(tenant: Tenant) -> None:
    final = check_grammar(stream(tenant, {"max_output_tokens": 4}, reasoning="", reply_tokens=30))
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 4


def test_a_filled_context_window_is_a_failed_context_length_exceeded(tenant: Tenant) -> None:
    """No max_output_tokens (Codex never sends it): output stopped because prompt + output filled the window."""
    final = check_grammar(stream(tenant, {"input": "word " * 32_740}, reasoning="", reply_tokens=100))
    assert final["status"] == "failed" and final["error"]["code"] == "context_length_exceeded"
    assert final["usage"]["input_tokens"] + final["usage"]["output_tokens"] == 32768


def test_the_money_running_out_ends_the_stream_as_incomplete(gateway: Gateway) -> None:
    tenant = gateway.new_key(key_fields={"spend_limit": "0.0003"})  # about 1000 output tokens
    final = check_grammar(stream(tenant, {}, reasoning="", reply_tokens=5000))
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["kiln_note"] and 0 < final["usage"]["output_tokens"] < 5000


# -- failures ---------------------------------------------------------------------------------


def test_context_overflow_is_a_200_stream_ending_in_response_failed(tenant: Tenant) -> None:
    """Codex trims its history on this code; an HTTP 400 would end its session."""
    s = stream(tenant, {"input": " word" * 40_000})
    final = check_grammar(s)
    assert [e["type"] for e in s.events] == ["response.created", "response.in_progress", "response.failed"]
    assert final["status"] == "failed" and final["error"]["code"] == "context_length_exceeded"
    assert "maximum context length" in final["error"]["message"]
    assert not tenant.usage()  # nothing was generated


def test_an_overflow_after_the_200_went_out_is_the_same_response_failed(tenant: Tenant) -> None:
    """The backend is silent past one keepalive interval, so the 200 is out before it refuses."""
    message = "This model's maximum context length is 32768 tokens. However, your prompt contains 40000 input tokens."
    s = stream(tenant, {}, delay_ms=1200, status=400, error_message=message)
    final = check_grammar(s)
    assert {e["type"] for e in s.events[2:-1]} == {"response.in_progress"}  # keepalives while waiting
    assert final["error"] == {"code": "context_length_exceeded", "message": message}


@pytest.mark.parametrize("fault", [{"drop_after": 6}, {"error_after": 6}], ids=["connection-lost", "in-band-error"])
def test_backend_death_mid_stream_is_response_failed_never_completed(tenant: Tenant, fault: dict[str, int]) -> None:
    s = stream(tenant, {}, reasoning="", reply_tokens=30, **fault)
    final = check_grammar(s)
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert s.of("response.completed") == [] and s.text()
    assert tenant.usage()[0]["status"] == "error"


@pytest.mark.parametrize("fault", [{"ttft_ms": 1500}, {"delay_ms": 1500}], ids=["slow-first-token", "slow-headers"])
def test_keepalives_are_numbered_in_progress_events(tenant: Tenant, fault: dict[str, int]) -> None:
    """Codex's idle timer resets only on an SSE event with data, so a comment would not keep it alive.

    conftest's gateway has keepalive_s = 0.5; slow-headers: the backend sends no
    status for 1.5 s, so the gateway commits to the 200 with response.created.
    """
    s = stream(tenant, {}, reply="ok", reasoning="", **fault)
    final = check_grammar(s)
    assert final["status"] == "completed" and not any(f.startswith(":") for f in s.frames)
    kinds = [e["type"] for e in s.events]
    first_item = kinds.index("response.output_item.added")
    assert kinds[:2] == ["response.created", "response.in_progress"] and first_item >= 3
    assert set(kinds[2:first_item]) == {"response.in_progress"}


# -- hang-ups ---------------------------------------------------------------------------------


def read_until(tenant: Tenant, body: dict[str, Any], kind: str) -> str:
    """Stream and hang up as soon as an event of type `kind` arrives; the generation id."""
    body = {"model": QWEN, "input": "Hello!", "stream": True, **body}
    with tenant.http() as client, client.stream("POST", "/v1/responses", json=body) as r:
        for line in r.iter_lines():
            if line == f"event: {kind}":
                break
        return r.headers["x-neocloud-generation-id"]


def settled(tenant: Tenant, gen_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        event = next((e for e in tenant.usage() if e["id"] == gen_id), None)
        if event is not None:
            return event
        time.sleep(0.05)
    raise AssertionError(f"no usage event for {gen_id}")


def test_hanging_up_right_after_response_completed_is_a_normal_end(tenant: Tenant) -> None:
    """Codex closes the connection as soon as it reads response.completed."""
    event = settled(tenant, read_until(tenant, {"sim": {"reply": "Bye."}}, "response.completed"))
    assert (event["status"], event["cancelled"]) == ("ok", False) and event["completion_tokens"] > 0


def test_hanging_up_mid_stream_cancels_the_generation_and_bills_what_was_made(tenant: Tenant, sim: Sim) -> None:
    before = sim.stats()["cancelled"]
    body = {"sim": {"token_delay_ms": 200, "reply_tokens": 60, "reasoning": ""}}
    event = settled(tenant, read_until(tenant, body, "response.output_text.delta"))
    assert event["cancelled"] is True and 0 < event["completion_tokens"] < 60
    deadline = time.monotonic() + 5
    while sim.stats()["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sim.stats()["cancelled"] > before


# -- the SDK ----------------------------------------------------------------------------------


def test_sdk_stream_helper_text(tenant: Tenant) -> None:
    sim = {"sim": {"reply": "Hi, streamer."}}
    with tenant.openai().responses.stream(model=QWEN, input="Hello!", extra_body=sim) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == "Hi, streamer." == final.output_text and final.status == "completed"
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


def test_sdk_stream_helper_function_call_round_trip(tenant: Tenant, sim: Sim) -> None:
    client = tenant.openai()
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    with client.responses.stream(model=QWEN, input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
                                 extra_body={"sim": {"tool_calls": calls}}) as s:
        arg_events = [e for e in s if e.type == "response.function_call_arguments.delta"]
        first = s.get_final_response()
    call = next(i for i in first.output if i.type == "function_call")
    assert arg_events[-1].snapshot == call.arguments and json.loads(call.arguments) == {"city": "Oslo"}
    history: list[Any] = [{"role": "user", "content": "Weather?"},
                          *(i.model_dump(exclude_none=True) for i in first.output),
                          {"type": "function_call_output", "call_id": call.call_id, "output": "snow"}]
    with client.responses.stream(model=QWEN, input=history, tools=[WEATHER],  # type: ignore[list-item]
                                 extra_body={"sim": {"reply": "It snows."}}) as s:
        second = s.get_final_response()
    assert second.output_text == "It snows."
    assert sim.last_body()["messages"][-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "snow"}


def test_sdk_stream_helper_survives_keepalives(tenant: Tenant) -> None:
    with tenant.openai().responses.stream(model=QWEN, input="Hello!",
                                          extra_body={"sim": {"ttft_ms": 1200, "reply": "Late."}}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert final.output_text == "Late." and kinds.count("response.in_progress") >= 2

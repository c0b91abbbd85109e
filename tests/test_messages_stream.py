"""POST /v1/messages with stream: true — Anthropic's typed SSE events, byte by byte and through the SDK.

`events()` reads the raw stream with httpx and `check_grammar()` asserts what
the Anthropic SDKs (hence Claude Code) rely on: an `event:` line naming every
frame, message_start first, contiguous block indexes with one block open at a
time, message_delta then message_stop at the end, and no [DONE].
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import anthropic
import httpx
import pytest

from conftest import Gateway, Sim, Tenant
from kiln.catalog import Backend, Catalog, Model
from kiln.core.money import Prices
from kiln.protocols.anthropic.messages import MessagesTranslator
from kiln.protocols.base import Context
from kiln.protocols.reasoning import ReasoningSeal
from test_messages import OSS, QWEN, WEATHER, ask, script, sdk

TWO_CALLS = [{"name": "get_weather", "arguments": {"city": "Paris"}},
             {"name": "get_weather", "arguments": {"city": "Oslo"}}]


@dataclass
class Stream:
    status: int
    headers: httpx.Headers
    events: list[tuple[str, dict[str, Any]]]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [data for name, data in self.events if name == kind]


def events(tenant: Tenant, body: dict[str, Any]) -> Stream:
    with tenant.http() as client, client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        raw = r.read().decode()
    return Stream(r.status_code, r.headers, parse(raw))


def parse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in (b for b in raw.split("\n\n") if b.strip()):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2, block
        name, data = lines[0][len("event: "):], json.loads(lines[1][len("data: "):])
        assert data["type"] == name
        out.append((name, data))
    return out


def check_grammar(stream: Stream) -> list[dict[str, Any]]:
    """Assert the event grammar of a complete stream; return the content blocks it built."""
    seq = [(n, d) for n, d in stream.events if n != "ping"]
    assert seq[0][0] == "message_start" and [n for n, _ in seq[-2:]] == ["message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    open_index = None
    for name, data in seq[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append(dict(data["content_block"], partial=""))
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta, block = data["delta"], blocks[open_index]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json",
                     "signature_delta": "signature"}[delta["type"]]
            key = "partial" if field == "partial_json" else field
            block[key] = (block[key] if field != "signature" else "") + delta[field]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial"] or "{}")
        del block["partial"]
    return blocks


# -- the event stream -------------------------------------------------------------------------


def test_text_stream_grammar_usage_and_header(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply": "Streaming works fine."})
    s = events(tenant, ask(tag, model="claude-opus-5-5"))
    assert s.status == 200 and s.headers["content-type"].startswith("text/event-stream")
    assert check_grammar(s) == [{"type": "text", "text": "Streaming works fine."}]
    start = s.of("message_start")[0]["message"]
    assert start["id"].startswith("msg_") and start["model"] == "claude-opus-5-5" and start["content"] == []
    [delta] = s.of("message_delta")
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    [event] = tenant.usage()
    assert event["id"] == s.headers["x-neocloud-generation-id"]
    assert start["usage"]["input_tokens"] == event["prompt_tokens"] > 0  # real input usage up front
    assert delta["usage"]["output_tokens"] == event["completion_tokens"] == 4
    assert delta["usage"]["input_tokens"] == event["prompt_tokens"] - event["cached_tokens"]
    assert "cost" not in json.dumps(s.events)


def test_thinking_block_then_text_with_a_signature_before_the_stop(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reasoning": "Think first.", "reply": "Answer."})
    s = events(tenant, {**ask(tag), "thinking": {"type": "adaptive"}})
    blocks = check_grammar(s)
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == "Think first." and blocks[0]["signature"]
    names = [n for n, d in s.events if n != "ping" and d.get("index") == 0]
    assert names[-2:] == ["content_block_delta", "content_block_stop"]
    assert s.of("content_block_delta")[names.index("content_block_stop") - 2]["delta"]["type"] == "signature_delta"


def test_tool_calls_stream_as_tool_use_blocks(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"tool_calls": TWO_CALLS})
    s = events(tenant, ask(tag, model=OSS, tools=[WEATHER]))
    blocks = check_grammar(s)
    assert [(b["type"], b["name"], b["input"]) for b in blocks] == [
        ("tool_use", "get_weather", {"city": "Paris"}), ("tool_use", "get_weather", {"city": "Oslo"})]
    assert all(b["id"].startswith("chatcmpl-tool-") for b in blocks)  # the backend's ids, unchanged
    assert all(d["content_block"]["input"] == {} for d in s.of("content_block_start"))
    assert len(s.of("content_block_delta")) > 4  # arguments stream in fragments
    assert s.of("message_delta")[0]["delta"]["stop_reason"] == "tool_use"


def test_tool_call_deltas_fragmented_the_ways_backends_fragment_them() -> None:
    """Id before name, two entries of one index in a chunk, a whitespace delta first, finish "stop"."""
    model = Model("m", [Backend("http://127.0.0.1:9/v1", "m")], Prices(Decimal(1), Decimal(1), Decimal(1)), 1000, 100)
    tr = MessagesTranslator(Context(Catalog([model]), ReasoningSeal(b"k" * 32)))
    tr.request({"model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    deltas = [
        {"role": "assistant", "content": ""},
        {"content": "\n\n"},
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function"}]},
        {"tool_calls": [{"index": 0, "function": {"name": "get_weather"}},
                        {"index": 0, "function": {"arguments": '{"ci'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}},
                        {"index": 1, "id": "call_b", "function": {"name": "get_time", "arguments": "{}"}}]},
    ]
    chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks[0]["usage"] = {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10}
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 9, "total_tokens": 19}})
    steps = [tr.chunk(json.dumps(c).encode()) for c in chunks] + [tr.chunk(b"[DONE]")]
    assert steps[-1][3] is True  # [DONE]: the translator needs no more
    usage = steps[-2][1]
    assert usage is not None
    raw = b"".join(out for out, *_ in steps) + tr.finish(usage, 0)
    stream = Stream(200, httpx.Headers(), parse(raw.decode()))
    assert [(b["id"], b["name"], b["input"]) for b in check_grammar(stream)] == [
        ("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_time", {})]
    assert stream.of("message_start")[0]["message"]["usage"]["input_tokens"] == 10
    [delta] = stream.of("message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] == 9


def test_one_tool_call_when_parallel_use_is_disabled_on_a_model_that_cannot_be_told(tenant: Tenant,
                                                                                   sim: Sim) -> None:
    tag = script(sim, {"tool_calls": TWO_CALLS})
    body = ask(tag, tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    blocks = check_grammar(events(tenant, body))
    assert [b["input"] for b in blocks] == [{"city": "Paris"}]


def test_ping_while_the_backend_is_silent(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"ttft_ms": 1600, "reply": "Late."})
    s = events(tenant, ask(tag))
    pings = [i for i, (n, _) in enumerate(s.events) if n == "ping"]
    assert len(pings) >= 2 and s.events[pings[0]][1] == {"type": "ping"}
    assert check_grammar(s) == [{"type": "text", "text": "Late."}]
    with sdk(tenant).messages.stream(**ask(tag)) as stream:  # the SDKs skip pings, wherever they come
        assert stream.get_final_message().content[0].text == "Late."


@pytest.mark.parametrize("fault", ["drop_after", "error_after"])
def test_backend_death_mid_stream_is_an_error_event_never_a_clean_stop(tenant: Tenant, sim: Sim, fault: str) -> None:
    tag = script(sim, {fault: 4, "reply_tokens": 40})
    s = events(tenant, ask(tag))
    names = [n for n, _ in s.events]
    assert names[-1] == "error" and "message_stop" not in names and "message_delta" not in names
    assert s.events[-1][1]["error"]["type"] == "api_error"
    [event] = tenant.usage()
    assert event["status"] == "error"
    with pytest.raises(anthropic.APIStatusError):
        with sdk(tenant).messages.stream(**ask(tag)) as stream:
            stream.get_final_message()


def test_upstream_rejection_before_the_stream_is_a_plain_http_error(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"status": 400, "error_message": "Invalid value for top_k."})
    with tenant.http() as client:
        resp = client.post("/v1/messages", json={**ask(tag), "stream": True})
    assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json")
    assert resp.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                      "message": "Invalid value for top_k."}}


def test_upstream_rejection_after_the_commit_is_an_error_event(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"delay_ms": 1200, "status": 400, "error_message": "Late rejection."})
    s = events(tenant, ask(tag))
    names = [n for n, _ in s.events]
    assert names[0] == "message_start", "Anthropic's grammar: message_start first, even before a ping"
    assert set(names[1:-1]) <= {"ping"} and len(names) >= 3
    assert s.events[-1] == ("error", {"type": "error", "error": {"type": "invalid_request_error",
                                                                 "message": "Late rejection."}})


@pytest.mark.parametrize("stop", ["END", '"É\\ND"'])  # the second needs escaping in message_delta
def test_stop_sequence_cut_by_the_gateway_in_a_stream(tenant: Tenant, sim: Sim, stop: str) -> None:
    tag = script(sim, {"reply": f"Alpha beta {stop} gamma delta epsilon.", "token_delay_ms": 2, "ignore_stop": True})
    s = events(tenant, {**ask(tag), "stop_sequences": [stop]})
    assert check_grammar(s) == [{"type": "text", "text": "Alpha beta "}]
    assert s.of("message_delta")[0]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    [event] = tenant.usage()
    assert event["completion_tokens"] == s.of("message_delta")[0]["usage"]["output_tokens"]
    assert stop != "END" or event["completion_tokens"] == 3  # what was generated up to the cut


def test_client_leaving_mid_stream_is_billed_for_what_was_generated(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply_tokens": 400, "token_delay_ms": 10})
    with tenant.http() as client, client.stream("POST", "/v1/messages", json={**ask(tag), "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line == "event: content_block_delta"
            if seen >= 5:
                break
    deadline = time.monotonic() + 5
    while not tenant.usage() and time.monotonic() < deadline:
        time.sleep(0.05)
    [event] = tenant.usage()
    assert event["cancelled"] and 5 <= event["completion_tokens"] < 400


def test_a_stream_the_money_runs_out_on_ends_cleanly_at_max_tokens(gateway: Gateway, sim: Sim) -> None:
    tenant = gateway.new_key(key_fields={"spend_limit": "0.0003"})  # about 1000 output tokens
    s = events(tenant, {**ask(script(sim, {"reply_tokens": 5000})), "max_tokens": 8000})
    blocks = check_grammar(s)
    [delta] = s.of("message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["kiln_note"]
    assert 0 < delta["usage"]["output_tokens"] < 5000 and len(blocks) == 1


# -- the SDK's stream helpers ------------------------------------------------------------


def test_sdk_stream_helpers_and_final_message(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reasoning": "Hmm.", "reply": "Hello there, streamer."})
    body = {**ask(tag), "thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}
    with sdk(tenant).messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there, streamer." and final.content[1].text == text
    assert final.content[0].type == "thinking" and final.content[0].thinking == "Hmm."
    [event] = tenant.usage()
    assert final.usage.output_tokens == event["completion_tokens"]
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == event["prompt_tokens"]


def test_sdk_streamed_tool_use_loop(tenant: Tenant, sim: Sim) -> None:
    client = sdk(tenant)
    tag = script(sim, {"tool_calls": TWO_CALLS[:1]})
    messages: list[Any] = [{"role": "user", "content": tag}]
    with client.messages.stream(model=QWEN, max_tokens=500, tools=[WEATHER], messages=messages) as stream:
        first = stream.get_final_message()
    [call] = first.content
    assert (first.stop_reason, call.type, call.input) == ("tool_use", "tool_use", {"city": "Paris"})
    done = script(sim, {"reply": "Sunny."})
    messages += [{"role": "assistant", "content": first.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": done}]}]
    with client.messages.stream(model=QWEN, max_tokens=500, tools=[WEATHER], messages=messages) as stream:
        second = stream.get_final_message()
    assert (second.stop_reason, second.content[0].text) == ("end_turn", "Sunny.")


def test_streamed_and_json_messages_meter_the_same(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reply": "Same either way."})
    with tenant.http() as client:
        json_resp = client.post("/v1/messages", json=ask(tag))
    events(tenant, ask(tag))
    stream_event, json_event = tenant.usage()
    assert json_event["id"] == json_resp.headers["x-neocloud-generation-id"]
    for field in ("prompt_tokens", "completion_tokens", "cost", "endpoint"):
        assert stream_event[field] == json_event[field]

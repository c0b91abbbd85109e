"""POST /v1/chat/completions with stream: true — the SSE contract, byte by byte and through the SDK.

httpx reads the raw event stream (framing, comments, [DONE], headers); the
official SDK checks what an SDK user sees. What the upstream received is read
back from the simulator via a unique `sim.tag` per request.
"""

from __future__ import annotations

import asyncio
import json
import time
from decimal import Decimal
from typing import Any

import httpx
import pytest

from conftest import HELLO, OSS, QWEN, QWEN_UPSTREAM, WEATHER, Sim, Tenant, new_tag, upstream, usage_cost, wait_for
from sse import SSE

TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TWO_CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
    {"name": "get_time", "arguments": {"city": "Oslo"}},
]


# -- helpers ---------------------------------------------------------------------------------


def stream(tenant: Tenant, body: dict[str, Any], tag: str | None = None, timeout: float = 30) -> SSE:
    body = {"stream": True, **body}
    if tag is not None:
        body["sim"] = {**body.get("sim", {}), "tag": tag}
    with httpx.Client(base_url=tenant.gw.url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=timeout) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            raw = r.read().decode()
    return SSE(r.status_code, r.headers, raw)


def never_reached(sim: Sim, tag: str) -> None:
    assert sim.tagged(tag) is None, "a request the gateway rejected reached the model server"


def assert_clean_stream(s: SSE, model: str = QWEN) -> None:
    """200, text/event-stream, `data:` frames only (plus comments), one [DONE] at the very end."""
    assert s.status == 200, s.raw
    assert s.headers["content-type"].startswith("text/event-stream")
    assert s.headers["x-neocloud-generation-id"].startswith("gen-")
    assert s.raw.endswith("data: [DONE]\n\n")
    for frame in s.frames:
        assert frame.startswith("data: ") or frame.startswith(":"), frame
    assert s.data.count("[DONE]") == 1 and s.data[-1] == "[DONE]"
    chunks = s.chunks
    assert chunks
    assert not any("error" in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1, "every chunk of one stream carries the same id"
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == model
    finals = [c for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason") is not None]
    assert len(finals) == 1, "exactly one chunk carries the finish_reason"


def event_for(tenant: Tenant, gen_id: str) -> dict[str, Any]:
    return {e["id"]: e for e in tenant.usage()}[gen_id]


# -- stream flag --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, "true", 1], ids=["true", "string-true", "one"])
def test_truthy_stream_values_stream_and_reach_upstream_as_json_true(tenant: Tenant, sim: Sim, value: Any) -> None:
    tag = new_tag()
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "stream": value}, tag)
    assert_clean_stream(s)
    assert upstream(sim, tag)["stream"] is True


@pytest.mark.parametrize("value", [False, "false", 0], ids=["false", "string-false", "zero"])
def test_falsy_stream_values_answer_json_and_reach_upstream_as_json_false(tenant: Tenant, sim: Sim, value: Any) -> None:
    tag = new_tag()
    with tenant.http() as client:
        resp = client.post(
            "/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "stream": value, "sim": {"tag": tag}}
        )
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.json()["object"] == "chat.completion"
    assert upstream(sim, tag)["stream"] is False


@pytest.mark.parametrize("value", ["yes", 2, -1, None, "null", "", [], {}, 0.5], ids=repr)
def test_other_stream_values_are_400_param_stream(tenant: Tenant, sim: Sim, value: Any) -> None:
    tag = new_tag()
    with tenant.http() as client:
        resp = client.post(
            "/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "stream": value, "sim": {"tag": tag}}
        )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "stream"
    assert "x-neocloud-generation-id" not in resp.headers
    never_reached(sim, tag)
    assert tenant.usage() == []


# -- stream_options and usage --------------------------------------------------------------------


@pytest.mark.parametrize("stream_value", ["absent", False], ids=["no-stream", "stream-false"])
def test_stream_options_without_stream_true_is_400(tenant: Tenant, sim: Sim, stream_value: Any) -> None:
    tag = new_tag()
    body: dict[str, Any] = {"model": QWEN, "messages": HELLO, "stream_options": {"include_usage": True}, "sim": {"tag": tag}}
    if stream_value != "absent":
        body["stream"] = stream_value
    with tenant.http() as client:
        resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "stream_options"
    never_reached(sim, tag)
    assert tenant.usage() == []


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}], ids=["absent", "empty", "false"])
def test_upstream_is_always_asked_for_usage(tenant: Tenant, sim: Sim, options: Any) -> None:
    tag = new_tag()
    body: dict[str, Any] = {"model": QWEN, "messages": HELLO}
    if options is not None:
        body["stream_options"] = options
    s = stream(tenant, body, tag)
    assert_clean_stream(s)
    assert upstream(sim, tag)["stream_options"]["include_usage"] is True


def test_without_include_usage_the_client_gets_no_usage_chunk(tenant: Tenant) -> None:
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "stream_options": {"include_usage": False}})
    assert_clean_stream(s)
    for c in s.chunks:
        assert c.get("usage") is None
        assert c["choices"], "no usage-only chunk (empty choices) without include_usage"
    assert s.chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # still metered: the header names the usage event
    event = event_for(tenant, s.headers["x-neocloud-generation-id"])
    assert event["completion_tokens"] > 0 and Decimal(event["cost"]) > 0


def test_include_usage_adds_a_final_usage_chunk_with_cost_matching_the_ledger(tenant: Tenant) -> None:
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "stream_options": {"include_usage": True}})
    assert_clean_stream(s)
    *body, last = s.chunks
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["cost"], Decimal) and usage["cost"] > 0
    assert usage["cost"] == usage_cost(QWEN, usage)
    assert s.data[-2] == last and s.data[-1] == "[DONE]"
    assert all(c.get("usage") is None for c in body)
    event = event_for(tenant, s.headers["x-neocloud-generation-id"])
    assert event["prompt_tokens"] == usage["prompt_tokens"]
    assert event["completion_tokens"] == usage["completion_tokens"]
    assert Decimal(event["cost"]) == usage["cost"]
    assert event["cancelled"] is False and event["status"] == "ok"
    assert event["model"] == QWEN


def test_a_long_stream_in_large_reads_arrives_whole_and_is_billed_exactly(tenant: Tenant) -> None:
    """8,000 tokens from a backend that sends them as fast as it can: the gateway reads them in
    large batches, passes runs of them through at once (up to where the money reserved so far
    runs out, block after block), and the client gets every token, the ledger the same count.
    The 10 s bound guards against work that grows with the square of a read's length (this
    takes 0.5 s here; it took 15 s when it did): it is not a performance target."""
    tokens = 8000
    started = time.monotonic()
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "max_tokens": tokens + 100,
                        "stream_options": {"include_usage": True}, "sim": {"reply_tokens": tokens}})
    assert time.monotonic() - started < 10
    assert_clean_stream(s)
    pieces = [c for c in s.chunks if c.get("choices") and (c["choices"][0]["delta"].get("content")
                                                           or c["choices"][0]["delta"].get("reasoning"))]
    usage = s.chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(pieces) >= tokens, (usage, len(pieces))
    assert all(c["model"] == QWEN for c in s.chunks)
    assert [c["choices"][0]["finish_reason"] for c in s.chunks if c.get("choices")][-1] == "stop"
    event = event_for(tenant, s.headers["x-neocloud-generation-id"])
    assert event["completion_tokens"] == usage["completion_tokens"] and Decimal(event["cost"]) == usage["cost"]


def test_stream_and_json_usage_agree(tenant: Tenant) -> None:
    messages = [{"role": "user", "content": "Tell me about rivers and stones."}]
    with tenant.http() as client:
        plain = client.post("/v1/chat/completions", json={"model": QWEN, "messages": messages}).json()
    s = stream(tenant, {"model": QWEN, "messages": messages, "stream_options": {"include_usage": True}})
    usage = s.chunks[-1]["usage"]
    assert s.content() == plain["choices"][0]["message"]["content"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_chunk_shape_follows_the_seed(tenant: Tenant) -> None:
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "sim": {"reply": "Hello! How can I help?"}})
    assert_clean_stream(s)
    with_choices = [c for c in s.chunks if c["choices"]]
    for c in with_choices[:-1]:
        assert c["choices"][0]["finish_reason"] is None
        assert c["choices"][0]["index"] == 0
        assert isinstance(c["created"], int)
    assert with_choices[-1]["choices"][0]["finish_reason"] == "stop"
    assert s.content() == "Hello! How can I help?"


# -- model names in chunks -------------------------------------------------------------------------


@pytest.mark.parametrize("model", [QWEN, "claude-opus-5-5"])
def test_every_chunk_names_the_model_as_the_client_did_and_upstream_gets_the_backend_name(
    tenant: Tenant, sim: Sim, model: str
) -> None:
    tag = new_tag()
    s = stream(tenant, {"model": model, "messages": HELLO, "stream_options": {"include_usage": True}}, tag)
    assert_clean_stream(s, model)  # checks `model` on every chunk, the usage chunk included
    assert QWEN_UPSTREAM not in s.raw
    assert upstream(sim, tag)["model"] == QWEN_UPSTREAM


def test_gpt_5_alias_streams_as_gpt_oss(tenant: Tenant) -> None:
    s = stream(tenant, {"model": "gpt-5", "messages": HELLO, "stream_options": {"include_usage": True}})
    assert_clean_stream(s, "gpt-5")
    assert s.chunks[-1]["usage"]["cost"] == usage_cost(OSS, s.chunks[-1]["usage"])


# -- the SDK ---------------------------------------------------------------------------------------


def test_sdk_streaming_text_and_usage(tenant: Tenant) -> None:
    client = tenant.openai()
    messages = [{"role": "user", "content": "Say something about mountains."}]
    plain = client.chat.completions.create(model=QWEN, messages=messages)
    raw = client.chat.completions.with_raw_response.create(
        model=QWEN, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    gen_id = raw.headers["x-neocloud-generation-id"]
    chunks = list(raw.parse())
    assert all(c.model == QWEN for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.model_extra["cost"] > 0
    assert event_for(tenant, gen_id)["completion_tokens"] == chunks[-1].usage.completion_tokens


def test_sdk_streaming_without_usage_ends_cleanly(tenant: Tenant) -> None:
    chunks = list(tenant.openai().chat.completions.create(model=OSS, messages=HELLO, stream=True))
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("model", [QWEN, OSS])
def test_reasoning_deltas_reach_the_client(tenant: Tenant, model: str) -> None:
    s = stream(tenant, {"model": model, "messages": HELLO})
    assert_clean_stream(s, model)
    assert s.reasoning().strip()
    assert s.content().strip()
    # reasoning comes first, then the answer
    kinds = [("reasoning" if c["choices"][0]["delta"].get("reasoning") else "content")
             for c in s.chunks if c["choices"] and (c["choices"][0]["delta"].get("reasoning") or c["choices"][0]["delta"].get("content"))]
    assert kinds == sorted(kinds, key=lambda k: k == "content")


def test_reasoning_text_streams_verbatim(tenant: Tenant) -> None:
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "sim": {"reasoning": "First, think. Then act.", "reply": "Ok."}})
    assert_clean_stream(s)
    assert s.reasoning() == "First, think. Then act."
    assert s.content() == "Ok."


# -- tool calls in a stream --------------------------------------------------------------------------


def accumulate_tool_calls(s: SSE) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for c in s.chunks:
        for choice in c["choices"]:
            for frag in choice["delta"].get("tool_calls") or ():
                call = calls.setdefault(frag["index"], {"id": "", "name": "", "arguments": ""})
                call["id"] += frag.get("id") or ""
                fn = frag.get("function") or {}
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
    return calls


@pytest.mark.parametrize("model", [QWEN, OSS])
def test_streamed_tool_call_fragments_accumulate_to_valid_json(tenant: Tenant, model: str) -> None:
    s = stream(tenant, {"model": model, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]})
    assert_clean_stream(s, model)
    calls = accumulate_tool_calls(s)
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"]
    args = json.loads(calls[0]["arguments"])
    assert args["city"] and args["unit"] == "celsius"
    fragments = sum(1 for c in s.chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls"))
    assert fragments > 2, "arguments arrive in several fragments"
    assert [c for c in s.chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_two_streamed_tool_calls_accumulate_by_index(tenant: Tenant) -> None:
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "tools": [WEATHER, TIME], "sim": {"tool_calls": TWO_CALLS}})
    assert_clean_stream(s)
    calls = accumulate_tool_calls(s)
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1]["arguments"]) == {"city": "Oslo"}


def test_sdk_stream_helper_assembles_tool_calls(tenant: Tenant) -> None:
    client = tenant.openai()
    with client.chat.completions.stream(
        model=QWEN, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
    ) as s:
        events = [e.type for e in s]
        final = s.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    assert final.model == QWEN
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"]


def test_parallel_tool_calls_false_on_qwen_streams_one_call(tenant: Tenant, sim: Sim) -> None:
    tag = new_tag()
    body = {
        "model": QWEN, "messages": HELLO, "tools": [WEATHER, TIME], "parallel_tool_calls": False,
        "stream_options": {"include_usage": True}, "sim": {"tool_calls": TWO_CALLS},
    }
    s = stream(tenant, body, tag)
    assert_clean_stream(s)
    assert "parallel_tool_calls" not in upstream(sim, tag)
    calls = accumulate_tool_calls(s)
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert s.chunks[-1]["choices"] == [] and s.chunks[-1]["usage"]["cost"] > 0


def test_parallel_tool_calls_false_on_qwen_through_the_sdk_helper(tenant: Tenant) -> None:
    with tenant.openai().chat.completions.stream(
        model=QWEN, messages=HELLO, tools=[WEATHER, TIME], parallel_tool_calls=False,
        extra_body={"sim": {"tool_calls": TWO_CALLS}},
    ) as s:
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_parallel_tool_calls_false_on_gpt_oss_is_forwarded_in_a_stream(tenant: Tenant, sim: Sim) -> None:
    tag = new_tag()
    body = {"model": OSS, "messages": HELLO, "tools": [WEATHER, TIME], "parallel_tool_calls": False,
            "sim": {"tool_calls": TWO_CALLS}}
    s = stream(tenant, body, tag)
    assert_clean_stream(s, OSS)
    assert upstream(sim, tag)["parallel_tool_calls"] is False
    assert list(accumulate_tool_calls(s)) == [0]


# -- keepalives ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sim_control", [{"ttft_ms": 1500}, {"delay_ms": 2000}], ids=["slow-first-token", "slow-headers"])
def test_keepalive_comments_while_the_backend_is_silent(tenant: Tenant, sim_control: dict[str, Any]) -> None:
    """conftest's gateway has keepalive_s = 0.5.

    slow-first-token: the backend answers 200 at once and thinks before its first
    chunk. slow-headers: the backend sends nothing at all for 2 s; the gateway
    waits one keepalive interval for a status it could still report as an
    error, then commits to the 200 and keeps the connection alive.
    """
    s = stream(tenant, {"model": QWEN, "messages": HELLO, "stream_options": {"include_usage": True}, "sim": sim_control})
    assert_clean_stream(s)
    frames = s.frames
    first_data = next(i for i, f in enumerate(frames) if f.startswith("data: "))
    assert first_data >= 2, f"expected keepalives before the first chunk: {frames[:4]}"
    assert all(f == ": keepalive" for f in frames[:first_data])
    assert ":" not in "".join(f[0] for f in frames[first_data:])  # none after the backend got going
    assert s.content()
    assert s.chunks[-1]["usage"]["cost"] > 0


def test_keepalive_comments_are_ignored_by_the_sdk(tenant: Tenant) -> None:
    chunks = list(tenant.openai().chat.completions.create(
        model=QWEN, messages=HELLO, stream=True, extra_body={"sim": {"ttft_ms": 1200, "reply": "Still here."}}
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Still here."


# -- disconnects -----------------------------------------------------------------------------------


def test_client_disconnect_cancels_upstream_and_bills_what_was_generated(tenant: Tenant, sim: Sim) -> None:
    wait_for(lambda: sim.stats()["in_flight"] == 0, what="an idle simulator")
    before = sim.stats()
    body = {
        "model": QWEN, "messages": HELLO, "stream": True,
        "sim": {"token_delay_ms": 200, "reply_tokens": 60, "reasoning": "Short thought."},
    }
    client = tenant.http()
    started = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        gen_id = r.headers["x-neocloud-generation-id"]
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == 2:
                    break
    client.close()
    assert time.monotonic() - started < 5, "the stream was read incrementally, not to the end"

    stats = wait_for(
        lambda: (s := sim.stats())["cancelled"] > before["cancelled"] and s["in_flight"] == 0 and s,
        what="the simulator to see the cancellation",
    )
    assert stats["completed"] == before["completed"]
    event = wait_for(
        lambda: next((e for e in tenant.usage() if e["id"] == gen_id), None), what="the usage event of the cancelled stream"
    )
    assert event["cancelled"] is True
    assert event["completion_tokens"] > 0
    assert event["prompt_tokens"] > 0
    assert Decimal(event["cost"]) > 0
    assert event["completion_tokens"] < 60, "only what was generated before the disconnect is billed"
    admitted = tenant.org()["in_flight"]
    assert admitted == 0, "the admission slot is released"


def test_a_keepalive_due_at_a_tick_is_dropped_if_the_stream_writes_first() -> None:
    """The keepalive timer decides at its tick and writes from a task a turn of the loop later;
    a chunk written in between makes that keepalive moot (it would land between two chunks)."""
    from kiln.http import StreamOut

    async def run() -> list[dict[str, object]]:
        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        out = StreamOut(send, [], lambda: b": keepalive\n\n", 0.5)
        out.last = time.monotonic() - 1.0  # silent for a second: a beat is due
        out._tick()  # the timer fires: due, so a beat task is scheduled
        out.last = time.monotonic()  # the stream writes a chunk in the same turn
        for _ in range(3):
            await asyncio.sleep(0)
        await out.close()
        return sent

    assert asyncio.run(run()) == []


def test_client_leaving_before_the_backend_answers_cancels_it_at_once(tenant: Tenant, sim: Sim) -> None:
    """The backend has not sent its headers yet (queued, or thinking), the client gives up: the
    backend request is cancelled then, not when the backend answers, and the stream is billed
    like any stream its client left (one event, the admission slot released)."""
    wait_for(lambda: sim.stats()["in_flight"] == 0, what="an idle simulator")
    before = sim.stats()
    body = {"model": QWEN, "messages": HELLO, "stream": True, "sim": {"delay_ms": 6000}}
    client = tenant.http()
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=body, timeout=0.3)  # no keepalive yet: nothing came
    client.close()
    left = time.monotonic()
    stats = wait_for(lambda: (s := sim.stats())["cancelled"] > before["cancelled"] and s["in_flight"] == 0 and s,
                     what="the simulator to see the cancellation", timeout=10)
    assert time.monotonic() - left < 3, "the backend request outlived its client"
    assert stats["completed"] == before["completed"]
    events = wait_for(lambda: [e for e in tenant.usage() if e["cancelled"]], what="the cancelled stream's event")
    assert len(events) == 1 and events[0]["completion_tokens"] == 0
    assert tenant.org()["in_flight"] == 0, "the admission slot is released"


# -- the backend connection --------------------------------------------------------------------


def test_a_finished_stream_leaves_its_backend_connection_to_the_next_request(tenant: Tenant, sim: Sim) -> None:
    """A backend's stream ends with `[DONE]`, and its HTTP answer a moment later (the chunked
    encoding's last chunk, often a read of its own): the connection still goes back to the pool
    once that end comes, so streams one after another use one connection, as JSON answers do.
    Closed instead, about half the streams paid for a new connection (the simulator saw 21 for
    these 40)."""
    bodies = {"/v1/chat/completions": ({"model": QWEN, "messages": HELLO}, "data: [DONE]"),
              "/v1/completions": ({"model": QWEN, "prompt": "hi", "max_tokens": 8}, "data: [DONE]"),
              "/v1/responses": ({"model": QWEN, "input": "hi"}, "event: response.completed"),
              "/v1/messages": ({"model": QWEN, "max_tokens": 16, "messages": HELLO}, "event: message_stop")}
    with tenant.http() as client:
        client.post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO})  # a warm connection
        sim.reset()
        for _ in range(10):
            for path, (body, end) in bodies.items():
                r = client.post(path, json={**body, "stream": True}, headers={"x-api-key": tenant.key})
                assert r.status_code == 200 and end in r.text, r.text[-300:]
    stats = sim.stats()
    assert stats["total"] == 40
    assert stats["connections"] <= 2, f"{stats['connections']} backend connections for 40 streams in a row"

"""Kiln in front of a real llama.cpp llama-server (SmolLM2-135M-Instruct), as a user would use it.

Every count is checked against the server's own: its chat template applied
(/apply-template) and tokenized (/tokenize), or the usage it reports. Outputs
are kept short and greedy (temperature 0), so the suite runs on 2 cores; the
model's answers are not judged, only what Kiln does with them. Known gaps of
today's Kiln are written as the correct expectation (tests/real/NOTES.md).
"""

from __future__ import annotations

import json
import socket
import threading
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import anthropic
import httpx
import openai
import pytest

from conftest import Tenant, wait_for
from real.conftest import CTX_PER_SLOT, MODEL, PRICES
from real.llama import LlamaServer

GEN_ID = "x-neocloud-generation-id"
HELLO = [{"role": "user", "content": "Say hello in three words."}]
COUNT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
LONG = [{"role": "user", "content": "Write the numbers from 1 to 1000, one per line."}]  # runs to max_tokens
SYSTEM = "You are a pirate. Answer like a pirate."
PREFILL = "The capital of France is"
TOO_LONG = "word " * (CTX_PER_SLOT + 100)
GREEDY = {"temperature": 0}  # the Anthropic SDK has no temperature argument; Kiln passes it on


def cost(prompt: int, cached: int, completion: int) -> Decimal:
    """What the catalog's prices make of these tokens, rounded half-up to the nanodollar as billed."""
    p_in, p_cached, p_out = (Decimal(p) for p in PRICES)
    usd = ((prompt - cached) * p_in + cached * p_cached + completion * p_out) / 10**6
    return usd.quantize(Decimal("1e-9"), rounding=ROUND_HALF_UP)


def event(tenant: Tenant, gen_id: str) -> dict[str, Any]:
    """The usage event of one generation id (metering a cut request happens off the response path)."""
    found = wait_for(lambda: [e for e in tenant.usage() if e["id"] == gen_id], timeout=10, what=f"event {gen_id}")
    assert len(found) == 1, found
    return found[0]


def sdk(tenant: Tenant) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tenant.gw.url, api_key=tenant.key, max_retries=0)


def sse(tenant: Tenant, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    """POST a streaming request, read it to the end: the response and its data payloads (exact decimals)."""
    with tenant.http() as client, client.stream("POST", path, json={**body, "stream": True}) as resp:
        raw = resp.read().decode()
    assert resp.status_code == 200, raw
    data = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    return resp, [d if d == "[DONE]" else json.loads(d, parse_float=Decimal) for d in data]


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0, **extra}


# -- Chat Completions ---------------------------------------------------------------------

def test_chat_json_counts_the_servers_prompt_tokens_and_bills_them(tenant: Tenant, llama: LlamaServer) -> None:
    raw = tenant.openai().chat.completions.with_raw_response.create(**chat(seed=7))
    reply = raw.parse()
    assert reply.model == MODEL and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens == llama.prompt_tokens(HELLO)
    assert 0 < usage.completion_tokens <= 8
    e = event(tenant, raw.headers[GEN_ID])
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    assert (e["prompt_tokens"], e["cached_tokens"], e["completion_tokens"]) == (
        usage.prompt_tokens, cached, usage.completion_tokens)
    assert Decimal(e["cost"]) == cost(usage.prompt_tokens, cached, usage.completion_tokens)


def test_chat_stream_with_usage_ends_with_one_usage_chunk(tenant: Tenant, llama: LlamaServer) -> None:
    chunks = list(tenant.openai().chat.completions.create(**chat(stream=True, stream_options={"include_usage": True})))
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.prompt_tokens == llama.prompt_tokens(HELLO)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tenant.openai().chat.completions.create(**chat()).choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["stop"], ["length"])


def test_chat_stream_without_usage_carries_none_and_is_still_metered(tenant: Tenant, llama: LlamaServer) -> None:
    resp, data = sse(tenant, "/v1/chat/completions", chat())
    assert data[-1] == "[DONE]"
    assert all("usage" not in d for d in data[:-1]), data
    e = event(tenant, resp.headers[GEN_ID])
    assert e["prompt_tokens"] == llama.prompt_tokens(HELLO) and e["status"] == "ok"


def test_chat_stop_strings_cut_the_output(tenant: Tenant) -> None:
    reply = tenant.openai().chat.completions.create(model=MODEL, messages=COUNT, max_tokens=40, stop=["4"],
                                                    temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content.startswith("1, 2, 3") and "4" not in reply.choices[0].message.content


def test_chat_json_schema_is_enforced(tenant: Tenant) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    reply = tenant.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is it sunny in Paris?"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    answer = json.loads(reply.choices[0].message.content)
    assert answer.keys() == {"city", "sunny"} and isinstance(answer["sunny"], bool)


def test_requests_right_after_a_stream_succeed(tenant: Tenant) -> None:
    """llama-server closes the connection after every stream (while announcing keep-alive)."""
    statuses = []
    with tenant.http() as client:
        for _ in range(3):
            with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=2, stream=True)) as resp:
                resp.read()
                statuses.append(resp.status_code)
            statuses.append(client.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code)
    assert statuses == [200] * 6


# -- legacy Completions -------------------------------------------------------------------

PROMPT = "The capital of France is"


def test_completions_json(tenant: Tenant, llama: LlamaServer) -> None:
    reply = tenant.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert reply.choices[0].text and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens == llama.text_tokens(PROMPT)
    assert 0 < reply.usage.completion_tokens <= 5


@pytest.mark.parametrize("include_usage", [True, False])
def test_completions_stream_shows_usage_only_when_asked(tenant: Tenant, llama: LlamaServer,
                                                        include_usage: bool) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    resp, data = sse(tenant, "/v1/completions", body)
    chunks = data[:-1]
    assert data[-1] == "[DONE]"
    carrying = [c for c in chunks if c.get("usage")]
    if include_usage:  # OpenAI: one extra chunk, choices empty, before [DONE]; no other chunk has usage
        assert carrying == [chunks[-1]] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["prompt_tokens"] == llama.text_tokens(PROMPT)
    else:
        assert carrying == []
    assert event(tenant, resp.headers[GEN_ID])["prompt_tokens"] == llama.text_tokens(PROMPT)


# -- Anthropic Messages -------------------------------------------------------------------

def input_tokens(usage: Any) -> int:
    """Anthropic's input_tokens exclude cache reads; the prompt is both."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_messages_text(tenant: Tenant, llama: LlamaServer) -> None:
    raw = sdk(tenant).messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY)
    message = raw.parse()
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert input_tokens(message.usage) == llama.prompt_tokens(HELLO)
    e = event(tenant, raw.headers[GEN_ID])
    assert (e["prompt_tokens"], e["cached_tokens"], e["completion_tokens"]) == (
        input_tokens(message.usage), message.usage.cache_read_input_tokens, message.usage.output_tokens)


def test_messages_system_prompt_is_the_first_system_message(tenant: Tenant, llama: LlamaServer) -> None:
    message = sdk(tenant).messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=HELLO, extra_body=GREEDY)
    assert input_tokens(message.usage) == llama.prompt_tokens([{"role": "system", "content": SYSTEM}, *HELLO])


def test_messages_stop_sequence_is_reported(tenant: Tenant) -> None:
    message = sdk(tenant).messages.create(model=MODEL, max_tokens=40, messages=COUNT, stop_sequences=["4"],
                                          extra_body=GREEDY)
    text = message.content[0].text
    assert "4" not in text and text.startswith("1, 2, 3")
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "4")


def test_messages_stop_sequence_is_reported_in_a_stream(tenant: Tenant) -> None:
    with sdk(tenant).messages.stream(model=MODEL, max_tokens=40, messages=COUNT, stop_sequences=["4"],
                                     extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "4" not in text and text.startswith("1, 2, 3")
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "4")


def test_messages_prefill_answers_only_the_continuation(tenant: Tenant) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": PREFILL}]
    body = {"model": MODEL, "max_tokens": 6, "messages": messages, "extra_body": GREEDY}
    with sdk(tenant).messages.stream(**body) as stream:
        streamed = "".join(stream.text_stream)
    answered = sdk(tenant).messages.create(**body).content[0].text
    assert streamed and not streamed.startswith(PREFILL)
    assert answered == streamed


def test_messages_stream(tenant: Tenant, llama: LlamaServer) -> None:
    with sdk(tenant).messages.stream(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and kinds.count("message_delta") == 1
    assert final.content[0].text and input_tokens(final.usage) == llama.prompt_tokens(HELLO)
    again = sdk(tenant).messages.create(model=MODEL, max_tokens=8, messages=HELLO, extra_body=GREEDY)
    assert again.content[0].text == final.content[0].text


# -- Responses ------------------------------------------------------------------------------

def test_responses_text(tenant: Tenant, llama: LlamaServer) -> None:
    reply = tenant.openai().responses.create(model=MODEL, input=HELLO[0]["content"], max_output_tokens=8,
                                             temperature=0)
    assert reply.output_text and reply.status in ("completed", "incomplete")
    assert reply.usage.input_tokens == llama.prompt_tokens(HELLO)
    assert 0 < reply.usage.output_tokens <= 8


def test_responses_stream(tenant: Tenant, llama: LlamaServer) -> None:
    events = list(tenant.openai().responses.create(model=MODEL, input=HELLO[0]["content"], max_output_tokens=8,
                                                   temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text
    assert final.usage.input_tokens == llama.prompt_tokens(HELLO)


# -- count_tokens ---------------------------------------------------------------------------

def test_count_tokens_is_the_servers_own_count(tenant: Tenant, llama: LlamaServer) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "Ahoy there, matey!"},
                {"role": "user", "content": "Now say goodbye, in French."}]
    counted = sdk(tenant).messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    expected = llama.prompt_tokens([{"role": "system", "content": SYSTEM}, *messages])
    billed = sdk(tenant).messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=messages)
    assert input_tokens(billed.usage) == expected
    assert counted.input_tokens == expected


# -- max_tokens and the context window ------------------------------------------------------

def test_max_tokens_ends_the_output_in_each_protocol(tenant: Tenant) -> None:
    reply = tenant.openai().chat.completions.create(model=MODEL, messages=LONG, max_tokens=3, temperature=0)
    assert (reply.choices[0].finish_reason, reply.usage.completion_tokens) == ("length", 3)
    message = sdk(tenant).messages.create(model=MODEL, max_tokens=3, messages=LONG, extra_body=GREEDY)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 3)
    response = tenant.openai().responses.create(model=MODEL, input=LONG[0]["content"], max_output_tokens=3,
                                                temperature=0)
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.usage.output_tokens == 3


def test_a_prompt_over_the_context_is_a_400_in_each_protocol_and_costs_nothing(tenant: Tenant) -> None:
    before = tenant.org()["credits"]
    too_long = [{"role": "user", "content": TOO_LONG}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as chat_err:
            tenant.openai().chat.completions.create(model=MODEL, messages=too_long, max_tokens=4, stream=stream)
        assert chat_err.value.status_code == 400 and chat_err.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as msg_err:
        sdk(tenant).messages.create(model=MODEL, max_tokens=4, messages=too_long)
    assert msg_err.value.body["error"]["type"] == "invalid_request_error"
    assert msg_err.value.body["error"]["message"].startswith("prompt is too long: ")
    assert f"> {CTX_PER_SLOT} maximum" in msg_err.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as resp_err:
        tenant.openai().responses.create(model=MODEL, input=TOO_LONG, max_output_tokens=4)
    assert resp_err.value.code == "context_length_exceeded"
    assert tenant.usage() == [] and tenant.org()["credits"] == before


def test_prompt_and_max_tokens_over_the_context_stop_at_the_context(tenant: Tenant, llama: LlamaServer) -> None:
    numbers = [{"role": "user", "content": "Continue this list: " + ", ".join(map(str, range(1, 90))) + ","}]
    prompt = llama.prompt_tokens(numbers)
    assert CTX_PER_SLOT - 150 < prompt < CTX_PER_SLOT - 20, prompt
    reply = tenant.openai().chat.completions.create(model=MODEL, messages=numbers, max_tokens=300, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == CTX_PER_SLOT
    message = sdk(tenant).messages.create(model=MODEL, max_tokens=300, messages=numbers, extra_body=GREEDY)
    assert message.stop_reason == "max_tokens"
    assert input_tokens(message.usage) + message.usage.output_tokens == CTX_PER_SLOT


# -- clients that leave ---------------------------------------------------------------------

def test_a_cut_stream_frees_the_slot_and_bills_the_exact_prompt(tenant: Tenant, llama: LlamaServer) -> None:
    predicted = llama.metric("llamacpp:tokens_predicted_total")
    seen = 0
    with tenant.http() as client, client.stream(
            "POST", "/v1/chat/completions", json={**chat(messages=LONG, max_tokens=300), "stream": True}) as resp:
        gen_id = resp.headers[GEN_ID]
        for line in resp.iter_lines():
            seen += '"content":"' in line
            if seen == 5:
                break
    wait_for(lambda: llama.busy() == 0, timeout=30, what="the slot to be freed")
    decoded = int(llama.metric("llamacpp:tokens_predicted_total") - predicted)
    e = event(tenant, gen_id)
    assert (e["status"], e["cancelled"]) == ("cancelled", True)
    assert Decimal(e["cost"]) == cost(e["prompt_tokens"], e["cached_tokens"], e["completion_tokens"])
    problems = []
    if decoded > seen + 30:
        problems.append(f"cut after {seen} tokens, the server generated {decoded} of 300")
    if not seen <= e["completion_tokens"] <= decoded:
        problems.append(f"billed {e['completion_tokens']} completion tokens; {seen} were sent, {decoded} generated")
    if e["prompt_tokens"] != llama.prompt_tokens(LONG):
        problems.append(f"billed {e['prompt_tokens']} prompt tokens, the server counts {llama.prompt_tokens(LONG)}")
    assert not problems, problems


def test_a_cancelled_request_frees_its_slot_while_other_traffic_flows(tenant: Tenant, llama: LlamaServer) -> None:
    """A non-streaming request whose client leaves, while another request keeps the server busy."""
    predicted = llama.metric("llamacpp:tokens_predicted_total")
    other: dict[str, Any] = {}

    def other_traffic() -> None:  # a long stream on the other slot, straight to llama-server
        body = {"messages": LONG, "max_tokens": 400, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", llama.url + "/v1/chat/completions", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith('data: {"choices":[]'):
                    other.update(json.loads(line[6:]))

    background = threading.Thread(target=other_traffic)
    background.start()
    wait_for(lambda: llama.busy() == 1, timeout=30, what="the other request to start")
    body = json.dumps({**chat(messages=LONG, max_tokens=150)}).encode()
    with socket.create_connection(("127.0.0.1", httpx.URL(tenant.gw.url).port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + tenant.key.encode() + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        at_cut = wait_for(lambda: cut_point(llama), timeout=60, what="the cancelled request to generate")
    background.join(300)
    wait_for(lambda: llama.busy() == 0, timeout=60, what="both slots to be idle")
    decoded = int(llama.metric("llamacpp:tokens_predicted_total") - predicted) - other["usage"]["completion_tokens"]
    [e] = wait_for(lambda: tenant.usage(), timeout=10, what="the cancelled request's event")
    assert e["status"] == "cancelled"
    problems = []
    if decoded > at_cut + 30:  # the client left while the other request streamed: it should stop within a few tokens
        problems.append(f"cut at {at_cut} tokens, the server generated {decoded} of 150 "
                        f"(billed {e['completion_tokens']} completion tokens)")
    if e["prompt_tokens"] != llama.prompt_tokens(LONG):
        problems.append(f"billed {e['prompt_tokens']} prompt tokens, the server counts {llama.prompt_tokens(LONG)}")
    assert not problems, problems


def cut_point(llama: LlamaServer) -> int | None:
    """Once both slots generate and the later one has 10 tokens: how many it has."""
    counts = [s["next_token"][0]["n_decoded"] for s in llama.slots() if s["is_processing"]]
    return min(counts) if len(counts) == 2 and min(counts) >= 10 else None


# -- the ledger -----------------------------------------------------------------------------

def test_the_ledger_is_what_the_clients_saw_and_what_the_credits_paid(tenant: Tenant) -> None:
    """One request per endpoint and form; each event holds the tokens and cost its client was shown."""
    before = Decimal(tenant.org()["credits"])
    seen: dict[str, tuple[int, int, int]] = {}  # generation id -> prompt, cached, completion tokens shown
    shown_cost: dict[str, Decimal] = {}  # where the body carries usage.cost
    with tenant.http() as client:
        for path, body in (("/v1/chat/completions", chat()), ("/v1/completions", {
                "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0})):
            r = client.post(path, json=body)
            gen_id, u = r.headers[GEN_ID], json.loads(r.content, parse_float=Decimal)["usage"]
            seen[gen_id], shown_cost[gen_id] = openai_tokens(u), u["cost"]
            resp, data = sse(tenant, path, {**body, "stream_options": {"include_usage": True}})
            gen_id, u = resp.headers[GEN_ID], data[-2]["usage"]
            seen[gen_id], shown_cost[gen_id] = openai_tokens(u), u["cost"]
        r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": HELLO})
        u = r.json()["usage"]
        seen[r.headers[GEN_ID]] = (u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"],
                                   u["output_tokens"])
        r = client.post("/v1/responses", json={"model": MODEL, "input": PROMPT, "max_output_tokens": 5})
        gen_id, u = r.headers[GEN_ID], json.loads(r.content, parse_float=Decimal)["usage"]
        cached = (u.get("input_tokens_details") or {}).get("cached_tokens", 0)
        seen[gen_id], shown_cost[gen_id] = (u["input_tokens"], cached, u["output_tokens"]), u["cost"]
    events = {e["id"]: e for e in tenant.usage()}
    assert events.keys() == seen.keys()
    for gen_id, tokens in seen.items():
        e = events[gen_id]
        assert (e["prompt_tokens"], e["cached_tokens"], e["completion_tokens"]) == tokens, (e, tokens)
        assert Decimal(e["cost"]) == cost(*tokens) == shown_cost.get(gen_id, cost(*tokens))
    spent = sum(Decimal(e["cost"]) for e in events.values())
    assert spent > 0 and before - Decimal(tenant.org()["credits"]) == spent


def openai_tokens(usage: dict[str, Any]) -> tuple[int, int, int]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage["prompt_tokens"], cached, usage["completion_tokens"]

"""Stop strings enforced by the gateway (README: "`stop` is enforced by the gateway (streaming included)").

The simulator runs in both modes: honouring `stop` like vLLM, and ignoring it
like the serving stacks the seed page warns about (`"ignore_stop": true` in the
request's own simulator controls). Either way the client must
see the text cut before the first stop string, finish_reason "stop", and a
billed request.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal
from typing import Any

import httpx
import pytest

from conftest import HELLO, QWEN, Sim, Tenant, new_tag, upstream
from sse import SSE



IGNORE_STOP = {"ignore_stop": True}  # per request: the simulator then ignores `stop` like some stacks do


@pytest.fixture(params=["ignore_stop", "honour_stop"])
def mode(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The simulator ignoring `stop` (the gateway must cut) or honouring it (nothing may break)."""
    return IGNORE_STOP if request.param == "ignore_stop" else {}


# -- helpers ---------------------------------------------------------------------------------


def body_for(reply: str, stop: Any, tag: str | None = None, quirks: dict[str, Any] = IGNORE_STOP,
             **extra: Any) -> dict[str, Any]:
    sim = {"reply": reply, "reasoning": "Plan the answer.", **quirks}
    if tag:
        sim["tag"] = tag
    return {"model": QWEN, "messages": HELLO, "stop": stop, "sim": sim, **extra}


def post(tenant: Tenant, body: dict[str, Any]) -> httpx.Response:
    with tenant.http() as client:
        return client.post("/v1/chat/completions", json=body)


def stream(tenant: Tenant, body: dict[str, Any]) -> SSE:
    with httpx.Client(base_url=tenant.gw.url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            raw = r.read().decode()
    return SSE(r.status_code, r.headers, raw)


def assert_clean_stream(s: SSE) -> None:
    assert s.status == 200, s.raw
    assert s.raw.endswith("data: [DONE]\n\n")
    assert s.data.count("[DONE]") == 1
    assert not any("error" in c for c in s.chunks)
    assert len({c["id"] for c in s.chunks}) == 1, "every chunk of one stream carries the same id"
    assert all(c["model"] == QWEN for c in s.chunks)
    assert all(c["object"] == "chat.completion.chunk" for c in s.chunks)
    assert all(isinstance(c.get("created"), int) for c in s.chunks), "every chunk carries `created`"


def billed(tenant: Tenant, gen_id: str) -> dict[str, Any]:
    event = {e["id"]: e for e in tenant.usage()}[gen_id]
    assert event["completion_tokens"] > 0
    assert event["prompt_tokens"] > 0
    assert Decimal(event["cost"]) > 0
    assert event["status"] == "ok" and event["cancelled"] is False
    return event


# -- cases ---------------------------------------------------------------------------------------

# (reply the model produces, stop, what the client must get)
CASES = {
    "single": ("Alpha beta STOP gamma delta", "STOP", "Alpha beta "),
    "in-list": ("Alpha beta STOP gamma delta", ["STOP"], "Alpha beta "),
    # "<|end|>" is five tokens: " <", "|", "end", "|", ">"
    "split-across-chunks": ("one two <|end|> three four", "<|end|>", "one two "),
    "spans-two-words": ("alpha beta gamma delta", "beta gamma", "alpha "),
    # "EN" could start "END" but is followed by " route": it must reach the client
    "near-miss-then-hit": ("The EN route ENDS here", "END", "The EN route "),
    "near-miss-punctuation": ("Wow! Really!? Yes", "!?", "Wow! Really"),
    "multiple-earliest-wins": ("alpha beta gamma zeta", ["zeta", "beta"], "alpha "),
    "multiple-overlapping": ("alpha gamma epsilon delta omega", ["gamma delta", "delta"], "alpha gamma epsilon "),
    "at-the-start": ("STOP right here", "STOP", ""),
}
NO_HIT = {
    "absent": ("Alpha beta gamma.", "STOP", "Alpha beta gamma."),
    "near-miss-at-the-end": ("Finish with EN", "END", "Finish with EN"),
    "prefix-at-the-end": ("We end with <|en", "<|end|>", "We end with <|en"),
    "case-differs": ("stop here Stop there", "STOP", "stop here Stop there"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_json_response_is_cut_before_the_stop_string(tenant: Tenant, mode: dict[str, Any], case: str) -> None:
    reply, stop, expected = CASES[case]
    resp = post(tenant, body_for(reply, stop, quirks=mode))
    assert resp.status_code == 200, resp.text
    data = json.loads(resp.text, parse_float=Decimal)
    choice = data["choices"][0]
    # a reply that is only reasoning has content null on vLLM (honour_stop, "at-the-start")
    assert (choice["message"]["content"] or "") == expected
    assert choice["finish_reason"] == "stop"
    event = billed(tenant, resp.headers["x-neocloud-generation-id"])
    assert event["completion_tokens"] == data["usage"]["completion_tokens"]
    assert Decimal(event["cost"]) == data["usage"]["cost"]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_stream_is_cut_before_the_stop_string(tenant: Tenant, mode: dict[str, Any], case: str) -> None:
    reply, stop, expected = CASES[case]
    s = stream(tenant, body_for(reply, stop, quirks=mode))
    assert_clean_stream(s)
    assert s.content() == expected
    assert s.finish_reasons() == ["stop"]
    assert all(c.get("usage") is None for c in s.chunks), "no usage chunk was asked for"
    billed(tenant, s.headers["x-neocloud-generation-id"])


@pytest.mark.parametrize("case", list(NO_HIT), ids=list(NO_HIT))
def test_text_without_the_stop_string_is_delivered_whole(tenant: Tenant, mode: dict[str, Any], case: str) -> None:
    reply, stop, expected = NO_HIT[case]
    resp = post(tenant, body_for(reply, stop, quirks=mode))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == expected
    assert resp.json()["choices"][0]["finish_reason"] == "stop"

    s = stream(tenant, body_for(reply, stop, quirks=mode))
    assert_clean_stream(s)
    assert s.content() == expected, "a held-back prefix must be flushed at the end of the output"
    assert s.finish_reasons() == ["stop"]


def test_stop_string_spanning_every_chunk_boundary(tenant: Tenant) -> None:
    """Text is emitted as early as possible: everything before a possible stop prefix arrives before the cut."""
    reply = "a <| b <|e c <|en d <|end e <|end| f <|end|> g"
    s = stream(tenant, body_for(reply, "<|end|>"))
    assert_clean_stream(s)
    assert s.content() == "a <| b <|e c <|en d <|end e <|end| f "
    assert s.finish_reasons() == ["stop"]


def test_stream_with_usage_after_a_stop_string(tenant: Tenant) -> None:
    s = stream(tenant, body_for("Alpha beta STOP gamma delta", "STOP", stream_options={"include_usage": True}))
    assert_clean_stream(s)
    assert s.content() == "Alpha beta "
    *_, last = s.chunks
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["completion_tokens"] > 0
    event = billed(tenant, s.headers["x-neocloud-generation-id"])
    assert Decimal(event["cost"]) == usage["cost"]
    assert event["completion_tokens"] == usage["completion_tokens"]
    assert event["prompt_tokens"] == usage["prompt_tokens"]


def test_nothing_after_the_stop_string_leaks_in_a_long_stream(tenant: Tenant) -> None:
    tail = " ".join(f"word{i}" for i in range(200))
    s = stream(tenant, body_for(f"Short answer. STOP {tail}", "STOP"))
    assert_clean_stream(s)
    assert s.content() == "Short answer. "
    assert "word" not in s.raw
    billed(tenant, s.headers["x-neocloud-generation-id"])


def test_stop_cut_cancels_the_rest_of_the_generation(tenant: Tenant, sim: Sim) -> None:
    """Once the gateway has cut at a stop string it stops the backend instead of reading the tail."""
    before = sim.stats()
    tail = " ".join(["filler"] * 100)
    body = body_for(f"Done. STOP {tail}", "STOP")
    body["sim"].update(token_delay_ms=30)
    started = time.monotonic()
    s = stream(tenant, body)
    elapsed = time.monotonic() - started
    assert_clean_stream(s)
    assert s.content() == "Done. "
    assert elapsed < 2.0, f"the client waited {elapsed:.1f} s for a tail it never sees"
    deadline = time.monotonic() + 5
    while sim.stats()["cancelled"] == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sim.stats()["cancelled"] == before["cancelled"] + 1
    billed(tenant, s.headers["x-neocloud-generation-id"])


def test_stop_is_forwarded_upstream(tenant: Tenant, sim: Sim) -> None:
    tag = new_tag()
    stops = ["STOP", "<|end|>"]
    resp = post(tenant, body_for("Alpha STOP beta", stops, tag, quirks={}))
    assert resp.status_code == 200, resp.text
    assert upstream(sim, tag)["stop"] == stops


def test_stop_through_the_sdk(tenant: Tenant) -> None:
    client = tenant.openai()
    extra = {"sim": {"reply": "Count: one, two, three, four.", **IGNORE_STOP}}
    resp = client.chat.completions.create(model=QWEN, messages=HELLO, stop=[" three", "four"], extra_body=extra)
    assert resp.choices[0].message.content == "Count: one, two,"
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=QWEN, messages=HELLO, stop=[" three", "four"], stream=True, extra_body=extra
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Count: one, two,"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert len(tenant.usage()) == 2


def test_stop_does_not_cut_reasoning(tenant: Tenant) -> None:
    body = {"model": QWEN, "messages": HELLO, "stop": "STOP",
            "sim": {"reasoning": "I should not STOP thinking.", "reply": "Answer STOP tail", **IGNORE_STOP}}
    resp = post(tenant, body)
    message = resp.json()["choices"][0]["message"]
    assert message["content"] == "Answer "
    assert message["reasoning"] == "I should not STOP thinking."


def test_stop_with_tool_calls_leaves_the_calls_intact(tenant: Tenant) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look something up.",
                                              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    body = {"model": QWEN, "messages": HELLO, "stop": "}", "tools": [tool],
            "sim": {"tool_calls": [{"name": "lookup", "arguments": {"q": "STOP"}}], **IGNORE_STOP}}
    resp = post(tenant, body)
    [call] = resp.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"q": "STOP"}
    s = stream(tenant, body)
    assert_clean_stream(s)
    args = "".join(
        tc["function"].get("arguments") or ""
        for c in s.chunks if c.get("choices")
        for tc in c["choices"][0]["delta"].get("tool_calls") or ()
    )
    assert json.loads(args) == {"q": "STOP"}


@pytest.mark.parametrize("stop", [123, [1, 2], {"a": "b"}, ["ok", None], [f"s{i}" for i in range(17)]],
                         ids=["number", "numbers", "object", "null-in-list", "too-many"])
def test_invalid_stop_is_400(tenant: Tenant, stop: Any) -> None:
    resp = post(tenant, body_for("text", stop))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "stop"
    assert "x-neocloud-generation-id" not in resp.headers
    assert tenant.usage() == []


@pytest.mark.parametrize("stop", [None, [], "", [""]], ids=["null", "empty-list", "empty-string", "list-of-empty"])
def test_empty_stop_changes_nothing(tenant: Tenant, stop: Any) -> None:
    resp = post(tenant, body_for("Alpha beta.", stop))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "Alpha beta."
    s = stream(tenant, body_for("Alpha beta.", stop))
    assert_clean_stream(s)
    assert s.content() == "Alpha beta."

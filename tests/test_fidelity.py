"""Answers as the clients' own APIs would send them, on points where a translation can drift.

Each test names what a real client reads: the model list in Anthropic's
shape for the Anthropic SDK, Anthropic's event grammar, the model name the
client asked for, thinking shown or omitted as asked (and still carried back
to the model), Codex's catalog and its keepalives, and a late system message
kept in its place.
"""

from __future__ import annotations

import json
from datetime import datetime
from decimal import Decimal
from typing import Any

import anthropic

from kiln.catalog import Model
from kiln.core.money import Prices

from conftest import OSS, QWEN, Sim, Tenant, new_tag
from test_messages import ask, post, script, sdk, upstream as upstream_of_tag
from test_messages_stream import check_grammar, events
from test_responses_stream import stream as responses_stream

ALIAS = "claude-opus-5-5"  # an alias of qwen3-32b in conftest's catalog


# -- GET /v1/models ----------------------------------------------------------------------------------


def test_models_list_in_anthropics_shape_for_the_anthropic_sdk(tenant: Tenant) -> None:
    page = sdk(tenant).models.list()
    by_id = {m.id: m for m in page.data}
    assert {QWEN, ALIAS, OSS} <= set(by_id)
    model = by_id[ALIAS]
    assert model.type == "model" and model.display_name == ALIAS
    assert isinstance(model.created_at, datetime)
    raw = tenant.http().get("/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    assert set(raw) == {"data", "first_id", "last_id", "has_more"}
    assert raw["first_id"] == raw["data"][0]["id"] and raw["last_id"] == raw["data"][-1]["id"]
    assert raw["has_more"] is False
    entry = next(m for m in raw["data"] if m["id"] == ALIAS)
    assert entry["alias_of"] == QWEN and entry["max_input_tokens"] == 32768
    assert "capabilities" not in entry and "tool_choice" in entry["kiln_capabilities"]  # no clash with Anthropic's
    openai_list = tenant.http().get("/v1/models").json()
    assert openai_list["object"] == "list" and all(m["object"] == "model" for m in openai_list["data"])
    assert all("capabilities" not in m and "kiln_capabilities" in m for m in openai_list["data"])


def test_codex_catalog_advertises_reasoning_summaries_for_reasoning_models(tenant: Tenant) -> None:
    """Codex shows reasoning summaries by default only when the catalog says `auto`."""
    codex = {m["slug"]: m for m in tenant.http().get("/v1/models").json()["models"]}
    assert codex[QWEN]["default_reasoning_summary"] == codex[OSS]["default_reasoning_summary"] == "auto"
    plain = Model("plain", [], Prices(Decimal(1), Decimal(1), Decimal(1)), 4096, 1024)
    assert plain.codex_listing("plain", 0)["default_reasoning_summary"] == "none"


# -- the model name the client sent ------------------------------------------------------------------


def test_every_protocol_echoes_the_alias_the_client_asked_for(tenant: Tenant) -> None:
    client = tenant.openai()
    assert client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}]).model == ALIAS
    assert client.completions.create(model=ALIAS, prompt="hi", max_tokens=4).model == ALIAS
    assert client.responses.create(model=ALIAS, input="hi").model == ALIAS
    assert sdk(tenant).messages.create(**ask("hi", model=ALIAS)).model == ALIAS
    s = responses_stream(tenant, {"model": ALIAS})
    assert {e["response"]["model"] for e in s.events if "response" in e} == {ALIAS}
    usage = tenant.usage()
    assert {e["model"] for e in usage} == {QWEN}  # the ledger names the catalog model


# -- Messages: message_start first, thinking as asked ----------------------------------------------------


def test_message_start_comes_at_once_when_the_first_token_is_slow(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"ttft_ms": 1600, "reply": "Late."})
    s = events(tenant, ask(tag))
    names = [n for n, _ in s.events]
    assert names[0] == "message_start" and names[1] == "ping"
    start = s.events[0][1]["message"]
    assert start["usage"]["input_tokens"] > 0 and start["usage"]["output_tokens"] == 0  # the prompt estimate
    final = s.of("message_delta")[0]["usage"]
    assert final["input_tokens"] > 0 and final["output_tokens"] > 0  # the backend's counts
    assert check_grammar(s) == [{"type": "text", "text": "Late."}]


def test_thinking_display_omitted_sends_the_signature_but_not_the_text(tenant: Tenant, sim: Sim) -> None:
    tag = script(sim, {"reasoning": "Secret plan.", "reply": "Done."})
    s = events(tenant, {**ask(tag), "thinking": {"type": "adaptive", "display": "omitted"}})
    blocks = check_grammar(s)
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == "" and blocks[0]["signature"]
    assert not [d for d in s.of("content_block_delta") if d["delta"]["type"] == "thinking_delta"]
    message = sdk(tenant).messages.create(**{**ask(tag), "thinking": {"type": "enabled", "budget_tokens": 1024,
                                                                      "display": "omitted"}})
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking == "" and thinking.signature
    # The client echoes the block back as it must; the model gets its reasoning again from the signature.
    follow = new_tag()
    body = ask("first", thinking={"type": "adaptive", "display": "omitted"})
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": thinking.signature},
                                          {"type": "text", "text": "Done."}]},
        {"role": "user", "content": f"next {follow}"},
    ]
    assert post(tenant, body).status_code == 200
    sent = upstream_of_tag(sim, follow)
    assert sent["messages"][-2]["reasoning"] == "Secret plan."


def test_a_forged_signature_gives_the_model_nothing(tenant: Tenant, sim: Sim) -> None:
    follow = new_tag()
    body = ask("first")
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "kiln-rs1.AAAA"},
                                          {"type": "text", "text": "Done."}]},
        {"role": "user", "content": f"next {follow}"},
    ]
    assert post(tenant, body).status_code == 200
    assert "reasoning" not in upstream_of_tag(sim, follow)["messages"][-2]


# -- Responses keepalives ----------------------------------------------------------------------------------


def test_responses_keepalives_are_small_whatever_the_request_carries(tenant: Tenant) -> None:
    """Codex sends ~40 KB of tools; a keepalive need not repeat them (one did, 9.5 KB each)."""
    tools = [{"type": "function", "name": f"tool_{i}", "description": "x" * 500,
              "parameters": {"type": "object", "properties": {}}} for i in range(20)]
    s = responses_stream(tenant, {"tools": tools}, reply="ok", reasoning="", ttft_ms=1600)
    frames = [f for f in s.frames if '"response.in_progress"' in f]
    keepalives = frames[1:]  # the first in_progress opens the stream and carries the whole skeleton
    assert len(keepalives) >= 2
    assert all(len(f) < 400 for f in keepalives), max(len(f) for f in keepalives)
    for frame in keepalives:
        data = json.loads(frame.partition("\ndata: ")[2])
        assert data["response"]["id"] == s.events[0]["response"]["id"] and data["response"]["status"] == "in_progress"
    created = s.events[0]["response"]
    assert len(created["tools"]) == 20  # the skeleton still echoes the request
    with tenant.openai().responses.stream(model=QWEN, input="hi", tools=tools,
                                          extra_body={"sim": {"ttft_ms": 1600, "reply": "ok", "tool_calls": []}}) as st:
        assert st.get_final_response().output_text == "ok"  # the SDK takes the short keepalives


# -- Chat: a late system message ---------------------------------------------------------------------------


def test_a_late_system_message_stays_in_place_as_a_user_turn(tenant: Tenant, sim: Sim) -> None:
    tag = new_tag()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First."},
        {"role": "assistant", "content": "One."},
        {"role": "system", "content": "Now answer in French."},
        {"role": "developer", "content": [{"type": "text", "text": "Keep it short."}]},
        {"role": "user", "content": "Second."},
    ]
    with tenant.http() as client:
        r = client.post("/v1/chat/completions", json={"model": QWEN, "messages": messages, "sim": {"tag": tag}})
    assert r.status_code == 200, r.text
    sent = sim.received(tag)["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user", "user", "user"]
    assert sent[0] == {"role": "system", "content": "Be brief."}
    assert sent[3] == {"role": "user", "content": "[System context]\nNow answer in French."}
    assert sent[4]["content"] == [{"type": "text", "text": "[System context]"}, {"type": "text", "text": "Keep it short."}]


def test_the_anthropic_sdk_reads_its_own_errors_on_the_model_list(tenant: Tenant) -> None:
    bad = anthropic.Anthropic(base_url=tenant.gw.url, api_key="sk-kiln-nope", max_retries=0)
    try:
        bad.models.list()
    except anthropic.AuthenticationError as exc:
        assert exc.status_code == 401 and exc.body["type"] == "error"  # type: ignore[index]
    else:
        raise AssertionError("an unknown key listed the models")

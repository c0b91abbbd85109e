"""Backends by kind (kiln/backends.py), on the simulator: what Kiln asks a server of each kind.

vLLM (detected from GET /version) is asked as the client asked. A server that
does not say which stop string matched (SGLang, llama.cpp: here the simulator
configured as `kind = "sglang"`) gets no `stop`, streams also for a JSON
client, and the JSON answer is assembled from its stream; the gateway cuts at
the stop string and knows which one it was. tests/real/ checks the same
against a real llama.cpp server.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from conftest import (
    HELLO, QWEN, QWEN_UPSTREAM, WEATHER, Gateway, Sim, Tenant, catalog_toml, new_tag, start_gateway, stop,
    wait_for,
)
from test_messages import ask, script, upstream as carrying


@pytest.fixture(scope="module")
def sglang(sim: Sim) -> Iterator[Gateway]:
    gw = start_gateway(catalog_toml(sim.url).replace(
        f'model = "{QWEN_UPSTREAM}"\n', f'model = "{QWEN_UPSTREAM}"\nkind = "sglang"\n', 1))
    yield gw
    stop(gw.proc)


def test_the_simulator_is_detected_as_vllm_and_asked_as_the_client_asked(tenant: Tenant, sim: Sim) -> None:
    backends = tenant.gw.admin.get("/backends").json()["data"]
    assert {b["kind"] for b in backends if b["model"] == QWEN} == {"vllm"}
    tag = new_tag()
    r = tenant.http().post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "stop": ["zzz"],
                                                         "sim": {"tag": tag}})
    assert r.status_code == 200
    sent = sim.received(tag)
    assert sent["stream"] is False and sent["stop"] == ["zzz"]


def test_a_json_client_is_served_from_a_stream_and_stop_is_kept_by_the_gateway(sglang: Gateway, sim: Sim) -> None:
    tenant = sglang.new_key()
    tag = new_tag()
    body = {"model": QWEN, "messages": HELLO, "stop": ["four"], "max_tokens": 200,
            "sim": {"tag": tag, "reply": "one two three four five six", "reasoning": "count"}}
    r = tenant.http().post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "one two three "
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "four")
    assert choice["message"]["reasoning"] == "count"
    sent = sim.received(tag)
    assert sent["stream"] is True and "stop" not in sent and sent["stream_options"] == {"include_usage": True}
    [event] = tenant.usage()
    assert event["completion_tokens"] > 0 and event["prompt_tokens"] > 0


def test_messages_learn_which_stop_sequence_matched(sglang: Gateway, sim: Sim) -> None:
    tenant = sglang.new_key()
    tag = script(sim, {"reply": "Alpha beta END gamma.", "reasoning": ""})
    with tenant.http() as client:
        message = client.post("/v1/messages", json={**ask(tag), "stop_sequences": ["never", "END"]}).json()
        with client.stream("POST", "/v1/messages", json={**ask(tag), "stop_sequences": ["never", "END"],
                                                          "stream": True}) as r:
            raw = r.read().decode()
    assert message["content"] == [{"type": "text", "text": "Alpha beta "}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    delta = next(json.loads(line[6:]) for line in raw.splitlines() if line.startswith('data: {"type":"message_delta"'))
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert "stop" not in carrying(sim, tag)


def test_tool_calls_and_usage_survive_assembly(sglang: Gateway, sim: Sim) -> None:
    tenant = sglang.new_key()
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}},
             {"name": "get_weather", "arguments": {"city": "Oslo"}}]
    r = tenant.openai().chat.completions.create(model=QWEN, messages=HELLO, tools=[WEATHER],
                                                extra_body={"sim": {"tool_calls": calls}})
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris", "Oslo"]
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.usage.completion_tokens > 0 and r.usage.model_extra["cost"] > 0
    several = tenant.openai().completions.create(model=QWEN, prompt=["a", "b", "c"], max_tokens=4)
    assert sorted(c.index for c in several.choices) == [0, 1, 2] and several.usage.completion_tokens == 12


def test_a_json_client_that_leaves_stops_the_generation(sglang: Gateway, sim: Sim) -> None:
    tenant = sglang.new_key()
    before = sim.stats()["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        tenant.http().post("/v1/chat/completions", timeout=0.8, json={
            "model": QWEN, "messages": HELLO, "max_tokens": 500, "sim": {"reply_tokens": 500, "token_delay_ms": 20}})
    wait_for(lambda: sim.stats()["cancelled"] > before, timeout=10, what="the backend to stop generating")
    event: dict[str, Any] = wait_for(lambda: next(iter(tenant.usage()), None), what="the cut request's event")
    assert event["cancelled"] is True and event["status"] == "cancelled"

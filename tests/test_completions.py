"""POST /v1/completions: the legacy text-completion endpoint, through the official SDK and raw HTTP.

The gateway forwards to the backend's /v1/completions; what the upstream
received is read back from the simulator via a unique `sim.tag`. Stop
strings are checked with the simulator ignoring them, so the gateway's own
enforcement is what the client sees.
"""

from __future__ import annotations

import json
import uuid
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import httpx
import openai
import pytest

from conftest import QWEN, QWEN_UPSTREAM, Sim, Tenant

PRICES = (Decimal("0.10"), Decimal("0.05"), Decimal("0.30"))  # conftest's qwen3-32b, USD per 1M tokens


IGNORE_STOP = {"ignore_stop": True}  # per request: the simulator then ignores `stop` like some stacks do


def tagged(body: dict[str, Any], **sim: Any) -> tuple[dict[str, Any], str]:
    tag = uuid.uuid4().hex
    return {**body, "sim": {**sim, "tag": tag}}, tag


def upstream(sim: Sim, tag: str) -> dict[str, Any] | None:
    found = sim.tagged(tag)
    if found is None:
        return None
    assert found[0] == "/v1/completions"
    return found[1]


def post(tenant: Tenant, body: dict[str, Any]) -> httpx.Response:
    with tenant.http() as client:
        return client.post("/v1/completions", json=body)


def stream_chunks(tenant: Tenant, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with tenant.http() as client, client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        raw = r.read().decode()
    data = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
    return r, [d if d == "[DONE]" else json.loads(d, parse_float=Decimal) for d in data]


def cost_of(usage: dict[str, Any]) -> Decimal:
    p_in, p_cached, p_out = PRICES
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    usd = ((usage["prompt_tokens"] - cached) * p_in + cached * p_cached + usage["completion_tokens"] * p_out) / 10**6
    return usd.quantize(Decimal("1e-9"), rounding=ROUND_HALF_UP)


def event(tenant: Tenant, gen_id: str) -> dict[str, Any]:
    return {e["id"]: e for e in tenant.usage()}[gen_id]


# -- JSON -------------------------------------------------------------------------------------


def test_sdk_completion_text_usage_and_cost_match_the_ledger(tenant: Tenant, sim: Sim) -> None:
    raw = tenant.openai().completions.with_raw_response.create(
        model=QWEN, prompt="Once upon a time", max_tokens=8, extra_body={"sim": {"tag": (tag := uuid.uuid4().hex)}}
    )
    completion = raw.parse()
    assert completion.object == "text_completion" and completion.model == QWEN
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    sent = upstream(sim, tag)
    assert sent is not None and sent["model"] == QWEN_UPSTREAM and sent["max_tokens"] == 8
    ev = event(tenant, raw.headers["x-neocloud-generation-id"])
    assert ev["endpoint"] == "completions" and ev["model"] == QWEN
    assert (ev["prompt_tokens"], ev["completion_tokens"]) == (completion.usage.prompt_tokens, 8)
    body = json.loads(raw.http_response.text, parse_float=Decimal)
    assert body["usage"]["cost"] == Decimal(ev["cost"]) == cost_of(body["usage"])


def test_max_tokens_defaults_to_16_and_is_capped_at_the_model_limit(tenant: Tenant, sim: Sim) -> None:
    body, tag = tagged({"model": QWEN, "prompt": "Tell me a long story"}, reply_tokens=40)
    r = post(tenant, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    assert upstream(sim, tag)["max_tokens"] == 16  # type: ignore[index]
    body, tag = tagged({"model": QWEN, "prompt": "x", "max_tokens": 10**6})
    assert post(tenant, body).status_code == 200
    assert upstream(sim, tag)["max_tokens"] == 8192  # type: ignore[index]  # conftest: max_output_tokens


@pytest.mark.parametrize(
    "prompt,choices",
    [("Hello", 1), (["Hello", "Good night"], 2), ([1, 2, 3], 1), ([[1, 2], [3, 4, 5]], 2)],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
def test_prompt_shapes(tenant: Tenant, prompt: Any, choices: int) -> None:
    r = post(tenant, {"model": QWEN, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(choices))


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({}, "prompt", None),
        ({"prompt": []}, "prompt", "empty_array"),
        ({"prompt": ["a", 1]}, "prompt", None),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens", None),
        ({"prompt": "a", "stream": "maybe"}, "stream", None),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", None),
        ({"prompt": "a", "echo": "loud"}, "echo", None),
        ({"prompt": "a", "logprobs": -2}, "logprobs", None),
        ({"prompt": "a", "suffix": " the end."}, "suffix", "unsupported_parameter"),
        ({"prompt": "a", "stop": [1]}, "stop", None),
    ],
    ids=["no-prompt", "empty-prompt", "mixed-prompt", "negative-max-tokens", "bad-stream", "options-without-stream",
         "bad-echo", "bad-logprobs", "suffix", "bad-stop"],
)
def test_invalid_requests_are_400_and_never_reach_the_backend(
    tenant: Tenant, sim: Sim, body: dict[str, Any], param: str, code: str | None
) -> None:
    body, tag = tagged({"model": QWEN, **body})
    r = post(tenant, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert upstream(sim, tag) is None
    assert not tenant.usage()


def test_unknown_model_is_404_model_not_found(tenant: Tenant) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        tenant.openai().completions.create(model="no-such-model", prompt="hi")
    assert info.value.code == "model_not_found"


def test_echo_and_logprobs(tenant: Tenant) -> None:
    r = post(tenant, {"model": QWEN, "prompt": "The sky is", "max_tokens": 3, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("The sky is") and len(choice["text"]) > len("The sky is")
    assert len(choice["logprobs"]["tokens"]) == 3
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])


def test_stop_is_enforced_by_the_gateway(tenant: Tenant) -> None:
    body, _ = tagged({"model": QWEN, "prompt": "Count", "stop": ["four"], "max_tokens": 50},
                     reply="one two three four five", **IGNORE_STOP)
    choice = post(tenant, body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("one two three ", "stop", "four")


def test_stop_never_cuts_the_echoed_prompt(tenant: Tenant) -> None:
    body, _ = tagged({"model": QWEN, "prompt": "four score", "stop": ["four"], "echo": True, "max_tokens": 50},
                     reply=" and seven four years", **IGNORE_STOP)
    choice = post(tenant, body).json()["choices"][0]
    assert choice["text"] == "four score and seven "


def test_backend_errors_keep_the_contract_shapes(tenant: Tenant) -> None:
    body, _ = tagged({"model": QWEN, "prompt": "x"}, status=500)
    r = post(tenant, body)
    assert r.status_code == 502 and r.headers["content-type"].startswith("text/plain")
    long_prompt = " word" * 40_000
    r = post(tenant, {"model": QWEN, "prompt": long_prompt})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# -- streaming --------------------------------------------------------------------------------


def test_sdk_stream_without_include_usage_has_no_usage_chunk(tenant: Tenant, sim: Sim) -> None:
    tag = uuid.uuid4().hex
    chunks = list(tenant.openai().completions.create(
        model=QWEN, prompt="Hello", max_tokens=5, stream=True, extra_body={"sim": {"tag": tag}}
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert all(c.usage is None and c.model == QWEN for c in chunks)
    assert upstream(sim, tag)["stream_options"] == {"include_usage": True}  # type: ignore[index]
    assert tenant.usage()[0]["completion_tokens"] == 5


def test_stream_usage_chunk_carries_the_ledger_cost(tenant: Tenant) -> None:
    r, data = stream_chunks(tenant, {"model": QWEN, "prompt": "Hello", "max_tokens": 6,
                                     "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and data[-1] == "[DONE]"
    usage = data[-2]["usage"]
    assert data[-2]["choices"] == [] and data[-2]["object"] == "text_completion"
    ev = event(tenant, r.headers["x-neocloud-generation-id"])
    assert usage["cost"] == Decimal(ev["cost"]) == cost_of(usage)
    assert (ev["prompt_tokens"], ev["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])


def test_streamed_stop_is_cut_by_the_gateway_and_billed_exactly(tenant: Tenant) -> None:
    body, _ = tagged({"model": QWEN, "prompt": "Count", "stop": ["four"], "max_tokens": 50,
                      "stream_options": {"include_usage": True}}, reply="one two three four five six", **IGNORE_STOP)
    r, data = stream_chunks(tenant, body)
    texts = [c["choices"][0] for c in data[:-1] if isinstance(c, dict) and c["choices"]]
    assert "".join(c["text"] for c in texts) == "one two three "
    assert (texts[-1]["finish_reason"], texts[-1]["stop_reason"]) == ("stop", "four")
    ev = event(tenant, r.headers["x-neocloud-generation-id"])
    assert ev["completion_tokens"] == 4  # "one two three four": continuous usage, not an estimate
    assert data[-2]["usage"]["cost"] == Decimal(ev["cost"])


def test_streamed_stop_never_cuts_the_echoed_prompt(tenant: Tenant) -> None:
    body, _ = tagged({"model": QWEN, "prompt": "four score", "stop": ["four"], "echo": True, "max_tokens": 50},
                     reply=" and seven four years", **IGNORE_STOP)
    _, data = stream_chunks(tenant, body)
    assert "".join(c["choices"][0]["text"] for c in data if isinstance(c, dict) and c["choices"]) == \
        "four score and seven "


def test_keepalive_comments_while_the_backend_is_silent(tenant: Tenant) -> None:
    body, _ = tagged({"model": QWEN, "prompt": "Hello", "max_tokens": 3}, ttft_ms=1500)
    with tenant.http() as client, client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert frames[0] == ": keepalive" and frames[-1] == "data: [DONE]"

"""Tests for the vLLM simulator (`kiln sim`), run as a real subprocess over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

MODEL = "demo-model"
THINKER = "think-model"
USER = [{"role": "user", "content": "Hello there, how are you today?"}]


class Sim:
    """A running simulator process plus clients pointed at it."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block the sim
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.sim", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            self.log.seek(0)
            raise RuntimeError(f"sim did not start: {line!r} {self.log.read()}")
        self.base = line.strip().rsplit(" ", 1)[-1]
        self.http = httpx.Client(base_url=self.base, timeout=10)
        self.openai = OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0)

    def chat(self, **body: Any) -> httpx.Response:
        body.setdefault("model", MODEL)
        body.setdefault("messages", USER)
        return self.http.post("/v1/chat/completions", json=body)

    def stream_events(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST a streaming request; return parsed data events ("[DONE]" kept as a string)."""
        out: list[Any] = []
        with self.http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def config(self, **patch: Any) -> dict[str, Any]:
        r = self.http.post("/sim/config", json=patch)
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict[str, int]:
        return self.http.get("/sim/stats").json()

    def close(self) -> None:
        self.http.close()
        self.proc.kill()
        self.proc.wait(timeout=5)
        self.log.seek(0)
        errors = self.log.read()
        self.log.close()
        assert "Traceback" not in errors, errors


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    s = Sim("--model", MODEL, "--model", THINKER, "--reasoning-models", THINKER, "--seed", "7")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(autouse=True)
def _restore_config(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests flip modes through /sim/config; put the original settings back afterwards."""
    if "sim" not in request.fixturenames:
        yield
        return
    s: Sim = request.getfixturevalue("sim")
    before = s.http.get("/sim/config").json()
    yield
    before.pop("host"), before.pop("port")
    s.config(**before)


def tokenize_count(sim: Sim, **body: Any) -> int:
    r = sim.http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["count"] == len(data["tokens"])
    return data["count"]


def content_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])


# --------------------------------------------------------------------------- basics


def test_models_health_and_listening_port(sim: Sim) -> None:
    assert sim.http.get("/health").status_code == 200
    models = sim.http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL, THINKER]
    assert all(m["owned_by"] == "vllm" and m["max_model_len"] == 32768 for m in models["data"])
    assert sim.openai.models.list().data[0].id == MODEL


def test_plain_chat_shape_usage_and_determinism(sim: Sim) -> None:
    r = sim.chat()
    assert r.status_code == 200
    assert '"model":"demo-model"' in r.text  # compact like vLLM
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None and choice["logprobs"] is None
    assert "tool_calls" not in choice["message"] and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].endswith(".")
    usage = body["usage"]
    assert usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == tokenize_count(sim, model=MODEL, messages=USER)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "completion_tokens_details" not in usage
    assert sim.chat().json()["choices"][0]["message"]["content"] == choice["message"]["content"]
    other = sim.chat(messages=[{"role": "user", "content": "Something else entirely"}]).json()
    assert other["choices"][0]["message"]["content"] != choice["message"]["content"]
    # the reply tokenizes to exactly completion_tokens tokens
    assert tokenize_count(sim, prompt=choice["message"]["content"]) == 24


def test_openai_sdk_chat_and_reply_override(sim: Sim) -> None:
    resp = sim.openai.chat.completions.create(
        model=MODEL, messages=USER, extra_body={"sim": {"reply": "Hi, friend!", "reply_tokens": 99}}
    )
    assert resp.choices[0].message.content == "Hi, friend!"
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    resp = sim.openai.chat.completions.create(model=MODEL, messages=USER, extra_body={"sim": {"reply_tokens": 5}})
    assert resp.usage is not None and resp.usage.completion_tokens == 5


def test_tokenize_matches_usage_with_tools_system_and_images(sim: Sim) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "What is this?"}]}]
    image = [
        text[0],
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
    ]
    n_text = tokenize_count(sim, model=MODEL, messages=text)
    n_image = tokenize_count(sim, model=MODEL, messages=image)
    assert n_image == n_text + 85
    n_tools = tokenize_count(sim, model=MODEL, messages=image, tools=tools)
    assert n_tools > n_image
    usage = sim.chat(messages=image, tools=tools, tool_choice="none").json()["usage"]
    assert usage["prompt_tokens"] == n_tools
    assert tokenize_count(sim, messages=image, add_generation_prompt=False) < n_image
    ids = sim.http.post("/tokenize", json={"prompt": "Hello, world!"}).json()
    assert ids["count"] == 4 and ids["max_model_len"] == 32768 and ids["token_strs"] is None
    assert sim.http.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "Hello, world!"}


# --------------------------------------------------------------------------- streaming


def test_stream_without_usage(sim: Sim) -> None:
    events = sim.stream_events("/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in c for c in chunks)
    assert len(chunks) == 24 + 2  # role + one chunk per token + final
    assert content_of(events) == sim.chat().json()["choices"][0]["message"]["content"]


def test_stream_with_include_usage_openai_sdk(sim: Sim) -> None:
    stream = sim.openai.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}, max_tokens=10
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"
    n_content = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert n_content == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_ttft_and_token_delay(sim: Sim) -> None:
    body = {"model": MODEL, "messages": USER, "stream": True, "sim": {"ttft_ms": 300, "token_delay_ms": 20, "reply_tokens": 5}}
    start = time.monotonic()
    with sim.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        t_first = time.monotonic() - start
        rest = [line for line in lines if line.startswith("data: ")]
    total = time.monotonic() - start
    assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    assert t_first >= 0.28
    assert total >= 0.28 + 4 * 0.02 - 0.01
    assert rest[-1] == "data: [DONE]"


# --------------------------------------------------------------------------- tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}


def test_tool_call_non_stream(sim: Sim) -> None:
    body = sim.chat(tools=[WEATHER, CLOCK]).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args["city"], str) and args["days"] == 1 and args["metric"] is True
    # after a tool result the model answers in text
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    after = sim.chat(messages=history, tools=[WEATHER]).json()["choices"][0]
    assert after["finish_reason"] == "stop" and after["message"]["content"]
    assert "tool_calls" not in after["message"]
    # a named choice picks that tool and finishes with "stop", like vLLM
    named = sim.chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}}).json()
    assert named["choices"][0]["finish_reason"] == "stop"
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    assert sim.chat(tools=[WEATHER], tool_choice="none").json()["choices"][0]["message"]["content"]


def test_tool_calls_stream_in_fragments(sim: Sim) -> None:
    forced = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]
    body = {"model": MODEL, "messages": USER, "tools": [WEATHER, CLOCK], "stream": True, "sim": {"tool_calls": forced}}
    events = sim.stream_events("/v1/chat/completions", body)
    calls: dict[int, dict[str, str]] = {}
    shared_chunk = False
    fragments = 0
    for e in events[:-1]:
        entries = e["choices"][0]["delta"].get("tool_calls") or []
        if len({x["index"] for x in entries}) == 1 and len(entries) == 2:
            shared_chunk = True
        for entry in entries:
            slot = calls.setdefault(entry["index"], {"id": "", "name": "", "arguments": ""})
            fn = entry.get("function", {})
            if "id" in entry:
                slot["id"] = entry["id"]
                slot["name"] = fn["name"]
                assert "arguments" not in fn
            if "arguments" in fn:
                fragments += 1
                assert 1 <= len(fn["arguments"]) <= 8
                slot["arguments"] += fn["arguments"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert shared_chunk and fragments > 6
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1]["arguments"]) == {"tz": "UTC"}
    # the openai SDK's stream helper reassembles the same calls
    with sim.openai.chat.completions.stream(
        model=MODEL, messages=USER, tools=[WEATHER, CLOCK], extra_body={"sim": {"tool_calls": forced}}
    ) as s:
        final = s.get_final_completion()
    got = [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls or []]
    assert got == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
    single = sim.chat(tools=[WEATHER, CLOCK], parallel_tool_calls=False, sim={"tool_calls": forced}).json()
    assert len(single["choices"][0]["message"]["tool_calls"]) == 1


def test_tool_validation_errors(sim: Sim) -> None:
    r = sim.chat(tools=[])
    assert r.status_code == 400 and "`tools` must not be an empty array" in r.json()["error"]["message"]
    r = sim.chat(tool_choice="auto")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "When using `tool_choice`, `tools` must be set."
    r = sim.chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and "does not match any of the specified `tools`" in r.json()["error"]["message"]


def test_forced_tool_choice_fails_mode(sim: Sim) -> None:
    assert sim.chat(tools=[WEATHER], tool_choice="required").json()["choices"][0]["finish_reason"] == "tool_calls"
    sim.config(forced_tool_choice_fails=True)
    r = sim.chat(tools=[WEATHER], tool_choice="required")
    assert r.status_code == 500 and r.text == "Internal Server Error"
    assert r.headers["content-type"].startswith("text/plain")
    named = sim.chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).json()
    choice = named["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    # auto still works in the broken stack
    assert sim.chat(tools=[WEATHER]).json()["choices"][0]["finish_reason"] == "tool_calls"


# --------------------------------------------------------------------------- reasoning, stop, length


def test_reasoning_models(sim: Sim) -> None:
    body = sim.chat(model=THINKER).json()
    msg, usage = body["choices"][0]["message"], body["usage"]
    assert msg["reasoning"] and msg["content"] and "reasoning_content" not in msg
    n_reasoning = tokenize_count(sim, prompt=msg["reasoning"])
    assert usage["completion_tokens_details"] == {"reasoning_tokens": n_reasoning}
    assert usage["completion_tokens"] == n_reasoning + 24
    off = sim.chat(model=THINKER, chat_template_kwargs={"enable_thinking": False}).json()
    assert "reasoning" not in off["choices"][0]["message"]
    assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert "reasoning" not in sim.chat().json()["choices"][0]["message"]
    explicit = sim.chat(sim={"reasoning": "Let me think.", "reply": "Done."}).json()["choices"][0]["message"]
    assert explicit["reasoning"] == "Let me think." and explicit["content"] == "Done."
    sim.config(reasoning_field="reasoning_content")
    events = sim.stream_events("/v1/chat/completions", {"model": THINKER, "messages": USER, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == msg["reasoning"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])


def test_stop_honoured_and_ignored(sim: Sim) -> None:
    reply = {"reply": "Hello world. Goodbye world."}
    body = sim.chat(stop=["Goodbye", "zzz"], sim=reply).json()
    choice = body["choices"][0]
    assert choice["message"]["content"] == "Hello world. "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "Goodbye"
    assert body["usage"]["completion_tokens"] == 4
    events = sim.stream_events("/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True, "stop": "Goodbye", "sim": reply})
    assert content_of(events) == "Hello world. " and events[-2]["choices"][0]["stop_reason"] == "Goodbye"
    sim.config(ignore_stop=True)
    body = sim.chat(stop=["Goodbye"], sim=reply).json()
    assert body["choices"][0]["message"]["content"] == "Hello world. Goodbye world."
    assert body["choices"][0]["stop_reason"] is None


def test_max_tokens_gives_length(sim: Sim) -> None:
    body = sim.chat(max_tokens=5).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert sim.chat(max_completion_tokens=3).json()["usage"]["completion_tokens"] == 3


def test_context_window_rules(sim: Sim) -> None:
    sim.config(max_model_len=64)
    long_msg = [{"role": "user", "content": "word " * 80}]
    n = tokenize_count(sim, messages=long_msg)
    r = sim.chat(messages=long_msg)
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": f"This model's maximum context length is 64 tokens. However, your prompt contains {n} input tokens, "
        "which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={n})",
        "type": "BadRequestError", "param": "input_tokens", "code": 400,
    }}
    n_small = tokenize_count(sim, messages=USER)
    clamped = sim.chat(max_tokens=1000).json()  # 0.33: silently clamped
    assert clamped["usage"]["completion_tokens"] == 24  # reply fits in the room left
    tight = sim.chat(max_tokens=1000, sim={"reply_tokens": 100}).json()
    assert tight["usage"]["completion_tokens"] == 64 - n_small and tight["choices"][0]["finish_reason"] == "length"
    sim.config(legacy_length_check=True)
    r = sim.chat(max_tokens=1000)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and err["message"] == (
        f"'max_tokens' or 'max_completion_tokens' is too large: 1000. This model's maximum context length is 64 "
        f"tokens and your request has {n_small} input tokens (1000 > 64 - {n_small})."
    )


def test_prefix_cache_reports_cached_tokens(sim: Sim) -> None:
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 20}, {"role": "user", "content": "first question"}]
    first = sim.chat(messages=msgs).json()["usage"]
    again = sim.chat(messages=msgs).json()["usage"]
    assert first["prompt_tokens"] > 100
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0 and again["prompt_tokens"] - 16 <= cached < again["prompt_tokens"]
    follow = sim.chat(messages=msgs[:1] + [{"role": "user", "content": "another question entirely"}]).json()["usage"]
    assert 0 < follow["prompt_tokens_details"]["cached_tokens"] < follow["prompt_tokens"] - 2
    sim.config(no_prompt_tokens_details=True)
    assert "prompt_tokens_details" not in sim.chat(messages=msgs).json()["usage"]


# --------------------------------------------------------------------------- validation


def test_vllm_400s(sim: Sim) -> None:
    r = sim.http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "Bad Request" and r.json()["error"]["code"] == 400
    r = sim.http.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert sim.chat(messages=[]).status_code == 400
    r = sim.chat(stream="true")
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    r = sim.chat(stream_options={"include_usage": True})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Stream options can only be defined when `stream=True`."
    r = sim.chat(model="missing-model")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `missing-model` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}


# --------------------------------------------------------------------------- faults and stats


def test_fault_status(sim: Sim) -> None:
    r = sim.chat(sim={"status": 503, "error_message": "overloaded"})
    assert r.status_code == 503
    assert r.json() == {"error": {"message": "overloaded", "type": "ServiceUnavailableError", "param": None, "code": 503}}
    r = sim.chat(sim={"status": 500})
    assert r.status_code == 500 and r.text == "Internal Server Error"
    r = sim.chat(sim={"status": 429, "headers": {"Retry-After": "2"}})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    start = time.monotonic()
    assert sim.chat(sim={"delay_ms": 200}).status_code == 200
    assert time.monotonic() - start >= 0.19


def test_drop_after_and_error_after(sim: Sim) -> None:
    sim.http.post("/sim/stats/reset")
    body = {"model": MODEL, "messages": USER, "stream": True, "sim": {"drop_after": 3}}
    seen: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        with sim.http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(line)
    assert len(seen) == 3 and "[DONE]" not in seen[-1]
    with pytest.raises(httpx.RemoteProtocolError):
        sim.chat(sim={"drop_after": 0})
    events = sim.stream_events("/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True, "sim": {"error_after": 4}})
    assert len(events) == 6 and events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "Simulated failure during generation", "type": "InternalServerError", "param": None, "code": 500}}
    stats = sim.stats()
    assert stats["errors"] == 3 and stats["cancelled"] == 0 and stats["total"] == 3


def _wait_stats(sim: Sim, key: str, value: int) -> dict[str, int]:
    deadline = time.monotonic() + 3
    while True:
        stats = sim.stats()
        if stats[key] >= value or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_client_disconnect_counts_as_cancelled(sim: Sim) -> None:
    sim.http.post("/sim/stats/reset")
    body = {"model": MODEL, "messages": USER, "stream": True, "sim": {"token_delay_ms": 50, "reply_tokens": 200}}
    with httpx.Client(base_url=sim.base) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                assert sim.stats()["in_flight"] == 1  # still generating
                break
    stats = _wait_stats(sim, "cancelled", 1)
    assert stats["cancelled"] == 1 and stats["in_flight"] == 0
    with pytest.raises(httpx.ReadTimeout):
        sim.http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "sim": {"delay_ms": 3000}}, timeout=0.3)
    stats = _wait_stats(sim, "cancelled", 2)
    assert stats["cancelled"] == 2 and stats["in_flight"] == 0 and stats["completed"] == 0
    assert stats["total"] == 2 and stats["max_in_flight"] >= 1


def test_sparse_polling_still_streams_every_token_and_notices_a_disconnect(sim: Sim) -> None:
    """sim.poll_ms (the benchmark's thousands of slow streams): fewer wake-ups, same stream,
    and a client that goes away mid-delay is still counted as cancelled at once."""
    slow = {"token_delay_ms": 300, "poll_ms": 300, "reply_tokens": 3}
    start = time.monotonic()
    events = sim.stream_events("/v1/chat/completions", {"model": MODEL, "messages": USER, "stream": True, "sim": slow})
    assert time.monotonic() - start >= 2 * 0.3 - 0.02
    assert sum(1 for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["delta"].get("content")) == 3
    assert events[-1] == "[DONE]"
    sim.http.post("/sim/stats/reset")
    body = {"model": MODEL, "messages": USER, "stream": True, "sim": {"token_delay_ms": 10_000, "poll_ms": 10_000}}
    with httpx.Client(base_url=sim.base) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        next(r.iter_lines())  # the role chunk, then a 10 s gap
    stats = _wait_stats(sim, "cancelled", 1)
    assert stats["cancelled"] == 1 and stats["in_flight"] == 0


# --------------------------------------------------------------------------- completions


def test_completions(sim: Sim) -> None:
    r = sim.http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time"})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 16
    assert body["usage"]["prompt_tokens"] == 4
    echo = sim.openai.completions.create(model=MODEL, prompt="Once upon a time", echo=True, max_tokens=3, logprobs=2)
    assert echo.choices[0].text.startswith("Once upon a time") and len(echo.choices[0].text) > 16
    lp = echo.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 3 and len(lp.top_logprobs or []) == 3
    assert "".join(lp.tokens or []) == echo.choices[0].text[16:]
    multi = sim.http.post("/v1/completions", json={"prompt": ["a b", "c d e"], "max_tokens": 2}).json()
    assert [c["index"] for c in multi["choices"]] == [0, 1] and multi["usage"]["prompt_tokens"] == 5
    ids = sim.http.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 2}).json()
    assert ids["usage"]["prompt_tokens"] == 5
    stopped = sim.http.post("/v1/completions", json={"prompt": "x", "stop": "b", "sim": {"reply": "a b c"}}).json()
    assert stopped["choices"][0]["text"] == "a " and stopped["choices"][0]["stop_reason"] == "b"


def test_completions_stream(sim: Sim) -> None:
    base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "stream": True}
    events = sim.stream_events("/v1/completions", base)
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert len(events) == 5 + 2 and events[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    plain = sim.http.post("/v1/completions", json={**base, "stream": False}).json()
    assert text == plain["choices"][0]["text"]
    with_usage = sim.stream_events("/v1/completions", {**base, "echo": True, "stream_options": {"include_usage": True}})
    assert with_usage[0]["choices"][0]["text"] == "Once upon a time"
    assert with_usage[-2]["choices"] == [] and with_usage[-2]["usage"]["completion_tokens"] == 5


# --------------------------------------------------------------------------- control endpoints


def test_sim_config_endpoint(sim: Sim) -> None:
    cfg = sim.http.get("/sim/config").json()
    assert cfg["models"] == [MODEL, THINKER] and cfg["reply_tokens"] == 24 and cfg["seed"] == 7
    new = sim.config(reply_tokens=3, ttft_ms=0)
    assert new["reply_tokens"] == 3
    assert sim.chat().json()["usage"]["completion_tokens"] == 3
    assert sim.http.post("/sim/config", json={"bogus": 1}).status_code == 400
    assert sim.http.post("/sim/config", json={"ignore_stop": "yes"}).status_code == 400
    assert sim.http.get("/sim/config").json()["ignore_stop"] is False


def test_per_request_settings_leave_the_global_ones_alone(sim: Sim) -> None:
    """A request's `sim` may set the quirks for itself (ignore_stop, legacy_length_check, ...)."""
    body = {"model": MODEL, "messages": USER, "stop": ["b"], "sim": {"reply": "a b c"}}
    honoured = sim.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    ignored = sim.http.post("/v1/chat/completions",
                            json={**body, "sim": {"reply": "a b c", "ignore_stop": True}}).json()
    assert honoured == "a " and ignored["choices"][0]["message"]["content"] == "a b c"
    assert sim.http.get("/sim/config").json()["ignore_stop"] is False
    legacy = sim.http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 10**6,
                                                         "sim": {"legacy_length_check": True}})
    assert legacy.status_code == 400
    assert sim.http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                       "max_tokens": 10**6}).status_code == 200


def test_rules_are_added_one_at_a_time(sim: Sim) -> None:
    for word in ("alpha", "beta"):
        assert sim.http.post("/sim/rules", json={"when": word, "sim": {"reply": word.upper()}}).status_code == 200
    said = [sim.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": f"say {w}"}]}).json()["choices"][0]["message"]["content"] for w in ("alpha", "beta")]
    assert said == ["ALPHA", "BETA"]
    assert sim.http.post("/sim/rules", json={"when": "", "sim": {}}).status_code == 400


def test_sim_requests_log(sim: Sim) -> None:
    sim.http.delete("/sim/requests")
    for i in range(105):
        sim.http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "sim": {"reply_tokens": 1}, "n_": i}, headers={"X-Test": str(i)})
    log = sim.http.get("/sim/requests").json()
    assert len(log) == 100
    assert log[-1]["path"] == "/v1/chat/completions"
    assert log[-1]["body"]["n_"] == 104 and log[0]["body"]["n_"] == 5
    assert log[-1]["headers"]["X-Test"] == "104"


def test_cli_flags_and_api_key() -> None:
    s = Sim(
        "--model", "m1", "--api-key", "sekret", "--ignore-stop", "--legacy-length-check", "--max-model-len", "128",
        "--no-prompt-tokens-details", "--reasoning-models", "m1", "--reasoning-field", "reasoning_content",
        "--reply-tokens", "6", "--forced-tool-choice-fails",
    )
    try:
        cfg = s.http.get("/sim/config").json()
        assert cfg["models"] == ["m1"] and cfg["ignore_stop"] and cfg["legacy_length_check"] and cfg["max_model_len"] == 128
        assert cfg["forced_tool_choice_fails"] and cfg["reply_tokens"] == 6
        body = {"model": "m1", "messages": USER, "stop": ["."], "sim": {"reply": "a. b."}}
        r = s.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert s.http.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert s.http.get("/health").status_code == 200
        auth = {"Authorization": "Bearer sekret"}
        data = s.http.post("/v1/chat/completions", json=body, headers=auth).json()
        assert data["choices"][0]["message"]["content"] == "a. b."
        assert data["choices"][0]["message"]["reasoning_content"]
        assert "prompt_tokens_details" not in data["usage"]
        r = s.http.post("/v1/chat/completions", json={**body, "max_tokens": 500}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        ok = OpenAI(base_url=f"{s.base}/v1", api_key="sekret", max_retries=0)
        assert ok.chat.completions.create(model="m1", messages=USER).usage.completion_tokens > 6  # type: ignore[union-attr]
    finally:
        s.close()


def test_stream_continuous_usage_stats(sim: Sim) -> None:
    """vLLM's extension: cumulative usage on every chunk (Kiln asks for it when it enforces stop)."""
    events = sim.stream_events("/v1/chat/completions", {
        "model": MODEL, "messages": USER, "stream": True, "max_tokens": 5,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    })
    chunks = [e for e in events if e != "[DONE]"]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    running = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert running[0] == 0 and running == sorted(running) and running[-1] == 5
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for c in chunks)


# --------------------------------------------------------------------------- replica identity and prefill cost


def test_id_names_the_replica_in_headers_and_stats() -> None:
    s = Sim("--model", MODEL, "--id", "replica-a")
    try:
        assert s.chat().headers["x-sim-id"] == "replica-a"
        assert s.http.get("/health").headers["x-sim-id"] == "replica-a"
        assert s.stats()["id"] == "replica-a"
    finally:
        s.close()


def test_id_defaults_to_the_listening_address(sim: Sim) -> None:
    assert sim.stats()["id"] == sim.base.removeprefix("http://")


def test_prefill_cost_is_proportional_to_uncached_prompt_tokens() -> None:
    """2000 µs per uncached token: a cold 600-token prompt takes over a second more than the same
    prompt again, which the prefix cache serves but for its last block."""
    s = Sim("--model", MODEL, "--prefill-us-per-token", "2000")
    try:
        messages = [{"role": "user", "content": "word " * 600}]
        s.http.post("/sim/stats/reset")
        times, usages = [], []
        for _ in range(2):
            start = time.monotonic()
            r = s.chat(messages=messages, max_tokens=1)
            times.append(time.monotonic() - start)
            usages.append(r.json()["usage"])
        cold, warm = usages
        assert cold["prompt_tokens_details"]["cached_tokens"] == 0
        uncached_warm = warm["prompt_tokens"] - warm["prompt_tokens_details"]["cached_tokens"]
        assert uncached_warm <= 16
        assert times[0] >= cold["prompt_tokens"] * 0.002
        assert times[0] - times[1] >= (cold["prompt_tokens"] - uncached_warm) * 0.002 - 0.1
        stats = s.stats()
        assert stats["prompt_tokens"] == cold["prompt_tokens"] + warm["prompt_tokens"]
        assert stats["cached_tokens"] == warm["prompt_tokens_details"]["cached_tokens"]
        events = s.stream_events("/v1/chat/completions", {"model": MODEL, "messages": messages, "stream": True})
        assert events[-1] == "[DONE]"
    finally:
        s.close()

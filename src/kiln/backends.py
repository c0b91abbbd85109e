"""What differs between model servers, in one place.

Kiln speaks OpenAI's chat completions and completions to every backend; the
servers differ around them (tests/real/NOTES.md for llama.cpp, measured;
protocols.md for vLLM and SGLang):

| | vLLM | SGLang | llama.cpp | other OpenAI-compatible |
|---|---|---|---|---|
| count a chat prompt | `/tokenize` with the messages | `/tokenize` with the messages | `/apply-template`, then `/tokenize` the text | cannot: estimated |
| which stop string ended a choice | `stop_reason` | not said | not said | not said |
| a JSON client that leaves | generation stops | generation stops | generation goes on while other requests run | unknown |
| prefill in a JSON answer | the continuation | the continuation | the prefill and the continuation | unknown |
| detected by | `GET /version` | `GET /get_server_info` | `GET /props` | none of these |

So for SGLang and llama.cpp Kiln enforces stop strings itself (it does not
forward `stop`: it sees the string, cuts there and knows which one matched)
and streams from the backend also for a JSON client: it stops reading at a
stop string, a client that leaves cancels the generation exactly, and the
JSON answer is assembled from the stream (assemble.py), which also gives a
llama.cpp prefill as the continuation only. vLLM is asked as the client
asked: it reports the matched stop and cancels a JSON request whose client
left, so it pays nothing for streaming it does not need. A server of unknown
kind ("openai") is asked as the client asked too (not every OpenAI-compatible
server takes `stream_options`); its stop strings are forwarded, and which one
matched is known only when the gateway itself cut there.

A backend's kind is set in the catalog (`kind`), or detected from its first
passing health check (`detect`); until then it is treated as "openai".
When no backend can count a prompt, `estimate` gives a rough size (the caller
logs that it did).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from kiln.catalog import Backend
from kiln.core.errors import GatewayError
from kiln.protocols.base import UpstreamCall, prompt_of
from kiln.upstream import Upstream

log = logging.getLogger("kiln.backends")


@dataclass(frozen=True, slots=True)
class Kind:
    name: str
    tokenizer: str  # "messages": /tokenize takes the chat; "template": /apply-template + /tokenize; "": none
    stream_always: bool  # stream from it also for JSON clients, and enforce stop strings in the gateway


KINDS = {
    "vllm": Kind("vllm", "messages", False),
    "sglang": Kind("sglang", "messages", True),
    "llamacpp": Kind("llamacpp", "template", True),
    "openai": Kind("openai", "", False),
}
BYTES_PER_TOKEN = 4  # English and JSON on common tokenizers: about 3.5-4


def kind_of(backend: Backend) -> Kind:
    return KINDS.get(backend.kind, KINDS["openai"])


def prepare(call: UpstreamCall, backend: Backend) -> tuple[bytes, bool]:
    """The request body for this backend, and whether it is asked to stream.

    A kind that streams always is not given `stop` (the translators enforce
    it: they see every piece) and is asked to stream for a JSON client too."""
    body = call.body
    if not kind_of(backend).stream_always or (call.stream and "stop" not in body):
        return call.encode(backend.model), call.stream
    adapted = {k: v for k, v in body.items() if k != "stop"}
    if not call.stream:
        adapted["stream"] = True
        adapted["stream_options"] = {"include_usage": True}
    adapted["model"] = backend.model
    return orjson.dumps(adapted), True


async def detect(upstream: Upstream, backend: Backend) -> str:
    """The kind a server says it is by what it serves (one cheap GET each, at most three)."""
    root = backend.url.removesuffix("/v1")
    for path, kind, field in (("/props", "llamacpp", "default_generation_settings"), ("/version", "vllm", "version"),
                              ("/get_server_info", "sglang", None)):
        data = await upstream.get_json(backend, root + path)
        if isinstance(data, dict) and (field is None or field in data):
            return kind
    return "openai"


async def count(upstream: Upstream, backends: list[Backend], payload: dict[str, Any],
                timeout_s: float = 10.0) -> int | None:
    """The first backend tokenizer's count of `payload`'s prompt (chat `messages` or completions
    `prompt`); None if no backend could count it."""
    for backend in backends:
        kind = kind_of(backend)
        if not kind.tokenizer:
            continue
        try:
            if kind.tokenizer == "template":
                value = await _count_by_template(upstream, backend, payload, timeout_s)
            else:
                value = await _count_by_messages(upstream, backend, payload, timeout_s)
        except GatewayError as exc:
            log.info("backend %s could not tokenize: %s", backend.url, exc.message)
            continue
        if value is not None:
            return value
    return None


async def _count_by_messages(upstream: Upstream, backend: Backend, payload: dict[str, Any],
                             timeout_s: float) -> int | None:
    """vLLM and SGLang: /tokenize renders the chat template itself; prompts one by one."""
    url = backend.url.removesuffix("/v1") + "/tokenize"
    if "messages" in payload:
        return _int(await upstream.post_json(backend, url, {**payload, "model": backend.model}, timeout_s), "count")
    total = 0
    for prompt in _prompts(payload.get("prompt")):
        if isinstance(prompt, list):
            total += len(prompt)
            continue
        n = _int(await upstream.post_json(backend, url, {"model": backend.model, "prompt": prompt}, timeout_s),
                 "count")
        if n is None:
            return None
        total += n
    return total


async def _count_by_template(upstream: Upstream, backend: Backend, payload: dict[str, Any],
                             timeout_s: float) -> int | None:
    """llama.cpp: /tokenize reads only text, so the chat is rendered first (/apply-template);
    `parse_special` counts the template's markers as the single tokens they are."""
    root = backend.url.removesuffix("/v1")
    if "messages" in payload:
        rendered = await upstream.post_json(
            backend, root + "/apply-template",
            prompt_of(payload), timeout_s)
        prompts: list[Any] = [rendered.get("prompt")] if isinstance(rendered, dict) else [None]
    else:
        prompts = _prompts(payload.get("prompt"))
    total = 0
    for prompt in prompts:
        if isinstance(prompt, list):
            total += len(prompt)
            continue
        if not isinstance(prompt, str):
            return None
        tokens = await upstream.post_json(backend, root + "/tokenize",
                                          {"content": prompt, "parse_special": True}, timeout_s)
        if not isinstance(tokens, dict) or not isinstance(tokens.get("tokens"), list):
            return None
        total += len(tokens["tokens"])
    return total


def estimate(payload: dict[str, Any]) -> int:
    """A rough prompt size from its JSON when no tokenizer could count it: about four bytes a token."""
    text = payload.get("messages") or payload.get("prompt") or ""
    return max(len(orjson.dumps(text)) // BYTES_PER_TOKEN, 1)


def _prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt) if isinstance(prompt, list) else []


def _int(data: object, name: str) -> int | None:
    value = data.get(name) if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

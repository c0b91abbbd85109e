"""vLLM wire format: error bodies, response bodies and SSE event bytes.

Everything is serialised compactly with orjson (vLLM emits ``"model":"name"``
without spaces). Stream events are built from a precomputed per-request prefix
so each token costs one small ``orjson.dumps`` and a few byte concatenations.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from .generate import Plan, ToolCall

JSON_CT = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
_dumps = orjson.dumps

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type(status: int) -> str:
    """vLLM-ish exception class name for a status code."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def error_obj(status: int, message: str, etype: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The ``{"error": {...}}`` object vLLM returns (and streams on mid-stream failure)."""
    return {"error": {"message": message, "type": etype or error_type(status), "param": param, "code": status}}


def error_response(
    status: int, message: str, etype: str | None = None, param: str | None = None
) -> web.Response:
    """A vLLM-shaped JSON error response."""
    return web.Response(status=status, body=_dumps(error_obj(status, message, etype, param)), content_type=JSON_CT)


def plain_500() -> web.Response:
    """What a crashed stack answers: plain text, no JSON."""
    return web.Response(status=500, text="Internal Server Error", content_type="text/plain")


def json_response(obj: Any, status: int = 200) -> web.Response:
    """Compact JSON response."""
    return web.Response(status=status, body=_dumps(obj), content_type=JSON_CT)


def usage_obj(
    prompt: int, completion: int, cached: int | None, reasoning: int | None = None
) -> dict[str, Any]:
    """OpenAI usage with vLLM's key order; cached=None omits prompt_tokens_details."""
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def _tool_call_obj(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_body(
    rid: str, created: int, model: str, plan: Plan, reasoning_field: str, usage: dict[str, Any]
) -> bytes:
    """Non-streaming chat.completion body."""
    if plan.tool_calls or (plan.reasoning and not plan.content):
        content: str | None = None
    else:
        content = "".join(plan.content)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if plan.reasoning:
        message[reasoning_field] = "".join(plan.reasoning)
    if plan.tool_calls:
        message["tool_calls"] = [_tool_call_obj(c) for c in plan.tool_calls]
    return _dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": plan.finish_reason,
                    "stop_reason": plan.stop_reason,
                }
            ],
            "usage": usage,
        }
    )


_FRAGMENT_SIZES = (5, 3, 8, 4, 7, 6)


def split_arguments(text: str) -> list[str]:
    """Cut argument JSON into 3-8 char fragments like an incremental parser emits."""
    out: list[str] = []
    pos = 0
    k = 0
    while pos < len(text):
        size = _FRAGMENT_SIZES[k % len(_FRAGMENT_SIZES)]
        out.append(text[pos : pos + size])
        pos += size
        k += 1
    return out


def _tool_events(calls: list[ToolCall]) -> list[bytes]:
    """Delta payloads (``{"tool_calls":[...]}``) in hermes-parser style.

    The first delta of a call has index/id/type/name (no arguments); later ones only
    argument fragments. From the second call on, the header and the first fragment
    share one chunk as two entries with the same index.
    """
    deltas: list[bytes] = []
    for i, call in enumerate(calls):
        header: dict[str, Any] = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name}}
        frags = split_arguments(call.arguments)
        if not frags:
            header["function"]["arguments"] = ""
            deltas.append(_dumps({"tool_calls": [header]}))
            continue
        if i == 0:
            deltas.append(_dumps({"tool_calls": [header]}))
        else:
            first = {"index": i, "function": {"arguments": frags.pop(0)}}
            deltas.append(_dumps({"tool_calls": [header, first]}))
        for frag in frags:
            deltas.append(_dumps({"tool_calls": [{"index": i, "function": {"arguments": frag}}]}))
    return deltas


def chat_events(
    rid: str,
    created: int,
    model: str,
    plan: Plan,
    reasoning_field: str,
    usage: dict[str, Any] | None,
    continuous: dict[str, Any] | None = None,
) -> tuple[list[bytes], int]:
    """All SSE events of a streamed chat completion, and the count of token events.

    Layout: role chunk, token chunks, final chunk (``delta:{}`` + finish_reason),
    optional usage chunk, ``[DONE]``.
    """
    head = (
        b'data: {"id":"' + rid.encode() + b'","object":"chat.completion.chunk","created":'
        + str(created).encode() + b',"model":' + _dumps(model) + b',"choices":[{"index":0,"delta":'
    )
    tail = b',"logprobs":null,"finish_reason":null}]}\n\n'
    events = [head + b'{"role":"assistant","content":""}' + tail]
    if plan.reasoning:
        key = b'{"' + reasoning_field.encode() + b'":'
        events.extend(head + key + _dumps(p) + b"}" + tail for p in plan.reasoning)
    events.extend(head + b'{"content":' + _dumps(p) + b"}" + tail for p in plan.content)
    if plan.tool_calls:
        events.extend(head + d + tail for d in _tool_events(plan.tool_calls))
    n_tokens = len(events) - 1
    events.append(
        head + b"{}" + b',"logprobs":null,"finish_reason":' + _dumps(plan.finish_reason)
        + b',"stop_reason":' + _dumps(plan.stop_reason) + b"}]}\n\n"
    )
    if continuous is not None:
        events = _with_running_usage(events, continuous)
    if usage is not None:
        events.append(
            b'data: {"id":"' + rid.encode() + b'","object":"chat.completion.chunk","created":'
            + str(created).encode() + b',"model":' + _dumps(model) + b',"choices":[],"usage":'
            + _dumps(usage) + b"}\n\n"
        )
    events.append(DONE)
    return events, n_tokens


def _with_running_usage(events: list[bytes], usage: dict[str, Any]) -> list[bytes]:
    """vLLM's continuous_usage_stats: cumulative usage on every chunk (role chunk: 0 tokens)."""
    prompt, total = usage["prompt_tokens"], usage["completion_tokens"]
    out = []
    for i, event in enumerate(events):
        done = total if i == len(events) - 1 else min(i, total)
        running = {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}
        out.append(event[: -len(b"}\n\n")] + b',"usage":' + _dumps(running) + b"}\n\n")
    return out


def completion_choice(index: int, text: str, logprobs: Any, plan: Plan) -> dict[str, Any]:
    """One non-streaming text_completion choice."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": plan.finish_reason,
        "stop_reason": plan.stop_reason,
        "prompt_logprobs": None,
    }


def completion_body(rid: str, created: int, model: str, choices: list[dict[str, Any]], usage: dict[str, Any]) -> bytes:
    """Non-streaming text_completion body."""
    return _dumps(
        {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices, "usage": usage}
    )


def completion_prefix(rid: str, created: int, model: str) -> bytes:
    """Shared beginning of every text_completion stream event."""
    return (
        b'data: {"id":"' + rid.encode() + b'","object":"text_completion","created":'
        + str(created).encode() + b',"model":' + _dumps(model) + b',"choices":'
    )


def completion_event(prefix: bytes, choice: dict[str, Any]) -> bytes:
    """One text_completion stream event carrying one choice."""
    return prefix + b"[" + _dumps(choice) + b"]}\n\n"


def completion_usage_event(prefix: bytes, usage: dict[str, Any]) -> bytes:
    """The final usage-only event (``choices: []``)."""
    return prefix + b'[],"usage":' + _dumps(usage) + b"}\n\n"


def with_completion_usage(events: list[bytes], running: list[int], prompt: int) -> list[bytes]:
    """continuous_usage_stats on /v1/completions: cumulative usage on every choice event."""
    return [
        event[: -len(b"}\n\n")] + b',"usage":'
        + _dumps({"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}) + b"}\n\n"
        for event, done in zip(events, running)
    ]


def stream_error_event(message: str) -> bytes:
    """The in-band error vLLM sends when generation fails mid-stream."""
    return b"data: " + _dumps(error_obj(500, message)) + b"\n\n"

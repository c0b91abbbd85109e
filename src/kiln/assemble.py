"""A JSON answer built from a backend's stream, for a client that asked for JSON.

Some model servers are asked to stream even when the client wants one JSON
body (backends.Kind.stream_always): a stream's cancellation is exact (llama.cpp
does not notice a non-streaming client that left while other requests run),
and the gateway can stop reading at a stop string it enforces itself. The
answer is then assembled here, in the backend's own chat-completions or
completions JSON shape, so the translators read it like any JSON answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import orjson

from kiln.protocols.chat_backed import backend_json, choices_of, part_of, tool_calls_of
from kiln.upstream import END_OF_STREAM, in_stream_error


@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)  # content (chat) or text (completions)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass(slots=True)
class Assembled:
    body: bytes  # the JSON answer
    pieces: int  # output pieces that came (about one token each): the estimate if no usage came
    complete: bool  # the backend ended the stream itself (else the gateway stopped reading at a stop string)


async def assemble(batches: AsyncIterator[list[bytes]], chat: bool, stops: list[str]) -> Assembled:
    """Read a chat (or completions) stream to its end, or until every choice has met a stop string."""
    head: dict[str, Any] = {}
    choices: dict[int, _Choice] = {}
    usage: Any = None
    pieces = 0
    async for batch in batches:
        for payload in batch:
            if payload == END_OF_STREAM:
                return Assembled(_body(head, choices, usage, chat), pieces, True)
            data = backend_json(payload)
            if "error" in data:
                raise in_stream_error(data)
            head = head or data
            if isinstance(data.get("usage"), dict):
                usage = data["usage"]
            for raw in choices_of(data):
                index = raw.get("index", 0)
                choice = choices.setdefault(index if isinstance(index, int) else 0, _Choice(index))
                pieces += _take(choice, raw, chat)
        if stops and choices and all(_stopped("".join(c.text), stops) for c in choices.values()):
            return Assembled(_body(head, choices, usage, chat), pieces, False)
    return Assembled(_body(head, choices, usage, chat), pieces, True)


def _take(choice: _Choice, raw: dict[str, Any], chat: bool) -> int:
    """Add one chunk's choice; 1 if it carried output."""
    said = 0
    if chat:
        delta = part_of(raw, "delta")
        for name, into in (("content", choice.text), ("reasoning", choice.reasoning),
                           ("reasoning_content", choice.reasoning)):
            value = delta.get(name)
            if isinstance(value, str) and value:
                into.append(value)
                said = 1
        for entry in tool_calls_of(delta):
            _tool_piece(choice, entry)
            said = 1
    elif isinstance(raw.get("text"), str) and raw["text"]:
        choice.text.append(raw["text"])
        said = 1
    _logprobs(choice, raw.get("logprobs"))
    if isinstance(raw.get("finish_reason"), str):
        choice.finish_reason = raw["finish_reason"]
        choice.stop_reason = raw.get("stop_reason")
    return said


def _tool_piece(choice: _Choice, entry: dict[str, Any]) -> None:
    index = entry.get("index", len(choice.calls))
    index = index if isinstance(index, int) else 0
    call = choice.calls.setdefault(index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    if isinstance(entry.get("id"), str) and entry["id"]:
        call["id"] = entry["id"]
    fn = entry["function"]
    call["function"]["name"] += fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""


def _logprobs(choice: _Choice, logprobs: Any) -> None:
    """Concatenate the per-chunk logprobs lists (chat: content; completions: tokens, ...)."""
    if not isinstance(logprobs, dict):
        return
    if choice.logprobs is None:
        choice.logprobs = {k: list(v) if isinstance(v, list) else v for k, v in logprobs.items()}
        return
    for key, value in logprobs.items():
        if isinstance(value, list) and isinstance(choice.logprobs.get(key), list):
            choice.logprobs[key].extend(value)


def _stopped(text: str, stops: list[str]) -> bool:
    return any(s in text for s in stops)


def _body(head: dict[str, Any], choices: dict[int, _Choice], usage: Any, chat: bool) -> bytes:
    out: dict[str, Any] = {"id": head.get("id", ""), "object": "chat.completion" if chat else "text_completion",
                           "created": head.get("created", 0), "model": head.get("model", ""), "choices": []}
    for index in sorted(choices):
        c = choices[index]
        entry: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
        if c.stop_reason is not None:
            entry["stop_reason"] = c.stop_reason
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text) or None}
            if c.reasoning:
                message["reasoning"] = "".join(c.reasoning)
            if c.calls:
                message["tool_calls"] = [c.calls[i] for i in sorted(c.calls)]
            entry["message"] = message
        else:
            entry["text"] = "".join(c.text)
        out["choices"].append(entry)
    if usage is not None:
        out["usage"] = usage
    return orjson.dumps(out)

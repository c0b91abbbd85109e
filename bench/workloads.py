"""What the benchmark sends: one request body per protocol and workload, and how to check an answer.

The simulator is started with `--reply-tokens 20`, so a request without a tag is answered
with 20 tokens (20 content chunks when streaming). Longer or slower replies are asked for
with a tag in the last user turn (`[bench reply=N delay=MS]`) that the simulator's `rules`
setting (/sim/config) turns into its per-request `sim` object, because Responses and
Messages bodies have no room for one; legacy Completions carries the `sim` object itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import agent_bodies

MODEL = "bench-model"
PROTOCOLS = ("chat", "completions", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}
UPSTREAM = {"chat": PATHS["chat"], "completions": PATHS["completions"],
            "responses": PATHS["chat"], "messages": PATHS["chat"]}  # where Kiln sends each protocol
REPLY_TOKENS = 20  # the simulator's default reply length
PROMPT = "Say hello to the benchmark in a few words."
AGENT_TAG = "[bench agent]"


def tag(tokens: int, delay_ms: int = 0) -> str:
    return f"[bench reply={tokens}" + (f" delay={delay_ms}" if delay_ms else "") + "]"


def sim_control(tokens: int, delay_ms: int = 0) -> dict[str, Any]:
    """The simulator's per-request `sim` object for a reply of `tokens` text tokens."""
    slow = {"token_delay_ms": delay_ms, "poll_ms": delay_ms} if delay_ms else {}  # poll: once per token
    return {"reply_tokens": tokens, "tool_calls": [], **slow}


@dataclass
class Workload:
    """One kind of request for one protocol; `direct` is the chat call Kiln makes for it (captured)."""

    name: str  # json | stream | agent | long-N | slow
    protocol: str
    body: dict[str, Any]
    tokens: int  # text tokens in the reply
    rules: list[dict[str, Any]] = field(default_factory=list)  # simulator rules it needs
    direct: dict[str, Any] | None = None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def path(self) -> str:
        return PATHS[self.protocol]

    @property
    def upstream_path(self) -> str:
        return UPSTREAM[self.protocol]

    @property
    def key(self) -> str:
        return f"{self.protocol}/{self.name}"


def make(protocol: str, name: str, stream: bool, tokens: int = REPLY_TOKENS, delay_ms: int = 0) -> Workload:
    """A small request of `protocol` whose reply is `tokens` text tokens (one a `delay_ms` when set)."""
    special = tokens != REPLY_TOKENS or delay_ms > 0
    text = f"{PROMPT} {tag(tokens, delay_ms)}" if special else PROMPT
    limit = max(tokens, 64)
    messages = [{"role": "user", "content": text}]
    if protocol == "chat":
        body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": limit}
    elif protocol == "completions":
        body = {"model": MODEL, "prompt": text, "max_tokens": limit}
        if special:
            body["sim"] = sim_control(tokens, delay_ms)
    elif protocol == "responses":
        body = {"model": MODEL, "input": text, "max_output_tokens": limit}
    else:
        body = {"model": MODEL, "messages": messages, "max_tokens": limit}
    if stream:
        body["stream"] = True
    rules = [{"when": tag(tokens, delay_ms), "sim": sim_control(tokens, delay_ms)}] if special else []
    return Workload(name, protocol, body, tokens, rules)


def agent(protocol: str) -> Workload:
    """The 60 KB agent turn: Claude Code-like for Messages, Codex-like for Responses (streaming)."""
    build = agent_bodies.claude_code_messages if protocol == "messages" else agent_bodies.codex_responses
    rules = [{"when": AGENT_TAG, "sim": sim_control(REPLY_TOKENS)}]  # a text answer, no tool call
    return Workload("agent", protocol, build(MODEL, AGENT_TAG), REPLY_TOKENS, rules)


def table_workloads(protocols: list[str], modes: list[str]) -> list[Workload]:
    """The side-by-side table's rows: json and/or stream per protocol, then the agent bodies."""
    out = [make(p, m, m == "stream") for p in protocols for m in modes if m in ("json", "stream")]
    if "agent" in modes:
        out += [agent(p) for p in ("messages", "responses") if p in protocols]
    return out


# -- reading answers -----------------------------------------------------------------------------


def sse_events(raw: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The JSON `data:` payloads of an SSE body, and whether it ended with `data: [DONE]`."""
    events, done = [], False
    lines = raw.split(b"\n")
    for line in lines if raw.endswith(b"\n") else lines[:-1]:  # a line still arriving is left out
        if line.startswith(b"data: {"):
            events.append(json.loads(line[6:]))
        elif line.strip() == b"data: [DONE]":
            done = True
    return events, done


def text_deltas(protocol: str, events: list[dict[str, Any]]) -> int:
    if protocol == "chat":
        return sum(1 for e in events for c in e.get("choices", []) if (c.get("delta") or {}).get("content"))
    if protocol == "completions":
        return sum(1 for e in events for c in e.get("choices", []) if c.get("text"))
    if protocol == "responses":
        return sum(1 for e in events if e.get("type") == "response.output_text.delta" and e.get("delta"))
    return sum(1 for e in events if e.get("type") == "content_block_delta"
               and (e.get("delta") or {}).get("type") == "text_delta")


def _finished(protocol: str, events: list[dict[str, Any]], done: bool) -> bool:
    if protocol in ("chat", "completions"):
        return done
    last = "response.completed" if protocol == "responses" else "message_stop"
    return any(e.get("type") == last for e in events)


def _output_tokens(protocol: str, body: dict[str, Any]) -> int | None:
    usage = body.get("usage") or {}
    value = usage.get("completion_tokens" if protocol in ("chat", "completions") else "output_tokens")
    return value if isinstance(value, int) else None


def check(protocol: str, stream: bool, tokens: int, status: int, raw: bytes) -> str | None:
    """None when `raw` is a complete answer of `tokens` text tokens; else what is wrong."""
    if status != 200:
        return f"HTTP {status}: {raw[:300]!r}"
    try:
        if stream:
            events, done = sse_events(raw)
            pieces = text_deltas(protocol, events)
            if not _finished(protocol, events, done):
                return f"stream did not finish ({len(events)} events): {raw[-300:]!r}"
            return None if pieces == tokens else f"expected {tokens} text chunks, got {pieces}"
        got = _output_tokens(protocol, json.loads(raw))
    except ValueError as exc:
        return f"unreadable answer ({exc}): {raw[:300]!r}"
    return None if got == tokens else f"expected {tokens} output tokens in usage, got {got}: {raw[:300]!r}"

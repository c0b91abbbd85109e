"""The translator contract: what every client protocol gives the pipeline.

A translator is made per request from a `Context` built once at start (the
catalog, the Responses reasoning seal), so making one costs no I/O and no
syscall. The pipeline calls, in order:

    call = tr.request(body)         # validate and map: an UpstreamCall, or a GatewayError (4xx)
    JSON:    usage = tr.response(raw)              then   tr.render(usage, cost_nano) -> bytes
    stream:  out, usage, tokens, done = tr.chunk(payload)   per upstream SSE payload, or for a run
             of them at once: out, usage, tokens, taken = tr.chunks(payloads, start, most)
             tr.truncate(note) -> bytes  (the money ran out)   then   tr.finish(usage, cost_nano) -> bytes
    always:  tr.keepalive() -> bytes, tr.error(err) -> Reply, tr.stream_error(err) -> bytes
    at the end: tr.finish_reason() -> str | None   (the ledger's: stop, length, tool_calls, ...)

Methods return values; the pipeline never reads or writes a translator's
attributes. It changes the upstream call only through `UpstreamCall`
(`lower_cap`, `encode`). Every translator is backed by an OpenAI-shaped
backend endpoint; what they share of that side lives in `ChatBacked`
(protocols/backed.py), and each protocol supplies only its own mapping.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from kiln.catalog import Catalog, Model
from kiln.core.admission import Demand
from kiln.core.errors import GatewayError
from kiln.core.records import Usage

if TYPE_CHECKING:
    from kiln.protocols.reasoning import ReasoningSeal

JSON = "application/json"
SSE = "text/event-stream"

# What one upstream SSE payload gave: bytes for the client, the usage it reported (or None),
# how many output pieces it delivered (about one token each), and whether the translator needs
# no more upstream payloads (the stream ended, or the gateway ended it, e.g. at a stop string).
Step = tuple[bytes, Usage | None, int, bool]
# What a run of plain payloads gave at once (Translator.chunks): bytes for the client, the latest
# usage among them (or None), output pieces, and how many payloads it took.
Run = tuple[bytes, Usage | None, int, int]


@dataclass(frozen=True, slots=True)
class Context:
    """What translators share across requests, built once at start."""

    catalog: Catalog
    seal: ReasoningSeal


@dataclass(slots=True)
class UpstreamCall:
    """What the backend is asked, as the pipeline needs to know it."""

    model: Model
    path: str  # on the backend's /v1 base: "/chat/completions" or "/completions"
    body: dict[str, Any]  # without "model": encode() names the backend's own model
    stream: bool
    max_output_tokens: int  # per output: the most the backend may generate
    outputs: int = 1  # completions the backend generates (prompts x n)
    tokenize: dict[str, Any] | None = None  # what the backend tokenizer counts; None: the chat body's prompt
    affinity: str | None = None  # routing key: requests with the same key share a prefix cache
    kind: str = "generation"  # "count": count the prompt, generate nothing

    def lower_cap(self, tokens: int) -> None:
        """Ask the backend for at most `tokens` per output (the money left covers no more)."""
        self.max_output_tokens = tokens
        self.body.pop("max_completion_tokens", None)
        self.body["max_tokens"] = tokens

    def prompt(self) -> dict[str, Any]:
        """What the backend's tokenizer counts: given, or a chat body's prompt (prompt_of), made
        when a count is needed (count_tokens, a cut stream's bill) rather than on every request."""
        return self.tokenize if self.tokenize is not None else prompt_of(self.body)

    def encode(self, backend_model: str) -> bytes:
        self.body["model"] = backend_model
        return orjson.dumps(self.body)

    def demand(self, endpoint: str, body_bytes: int) -> Demand:
        """The most the call can cost, for admission: one prompt token per body byte (no more
        than the context window holds), and its output cap for each output."""
        model = self.model
        return Demand(prompt_tokens_max=min(body_bytes, model.context_window),
                      input_nano_per_token=model.prices.input * 1000, output_nano_per_token=model.prices.output * 1000,
                      max_output_tokens=self.max_output_tokens, stream=self.stream, outputs=self.outputs,
                      model=model.id, endpoint=endpoint, kind=self.kind)


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes
    media_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


class Translator(Protocol):
    endpoint: str  # the ledger's name for it, e.g. "chat.completions"

    def request(self, body: Any) -> UpstreamCall: ...
    def response(self, raw: bytes) -> Usage | None: ...
    def render(self, usage: Usage, cost_nano: int) -> bytes: ...
    def chunk(self, payload: bytes) -> Step: ...
    def chunks(self, payloads: list[bytes], start: int, most: int) -> Run | None: ...
    def truncate(self, note: str) -> bytes: ...
    def finish(self, usage: Usage, cost_nano: int) -> bytes: ...
    def keepalive(self) -> bytes: ...
    def error(self, err: GatewayError) -> Reply: ...
    def stream_error(self, err: GatewayError) -> bytes: ...
    def finish_reason(self) -> str | None: ...


# The chat-request fields a chat template reads: what a tokenizer needs besides the messages.
TEMPLATE_KEYS = ("tools", "chat_template_kwargs", "continue_final_message", "add_generation_prompt")


def prompt_of(chat: dict[str, Any]) -> dict[str, Any]:
    """The part of a chat request that makes its prompt, for the backend's tokenizer."""
    return {k: chat[k] for k in ("messages", *TEMPLATE_KEYS) if k in chat}


def new_id(prefix: str) -> str:
    """A unique id for a response object or item: 96 random bits, no syscall (not a secret)."""
    return f"{prefix}{random.getrandbits(96):024x}"


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """One SSE event with its `event:` line (the Anthropic SDKs dispatch on it; Codex reads `data`)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def as_bool(value: Any) -> bool | None:
    """The contract's lenient booleans: true/false, "true"/"false", 1/0; None if none of them."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

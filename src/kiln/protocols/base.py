"""What every client protocol module provides, and helpers they share.

A translator is created per request. The pipeline calls, in order:
`request()` (validate and map the client's body to a chat-completions body
for the backend), then either `response()` + `render()` for JSON or
`chunk()` per upstream SSE payload + `finish()` for streams, and `error()`
/ `stream_error()` whenever something fails. Usage accumulates in `usage`.
Adding a protocol means adding a module with this surface; the pipeline
does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from kiln.catalog import Backend, Catalog, Model
from kiln.core.errors import GatewayError
from kiln.core.records import Usage

JSON = "application/json"
SSE = "text/event-stream"


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes
    media_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


class Translator(Protocol):
    endpoint: str  # the ledger's name for it, e.g. "chat.completions"
    upstream_path: str  # where it goes on the backend, e.g. "/chat/completions"
    model: Model
    stream: bool
    usage: Usage
    chunks: int  # content-bearing chunks seen (a completion-token estimate)
    done: bool  # the translator needs no more upstream chunks (e.g. a stop string)

    def __init__(self, catalog: Catalog) -> None: ...
    def request(self, body: Any) -> dict[str, Any]: ...
    def upstream_body(self, backend: Backend) -> bytes: ...
    def response(self, raw: bytes) -> None: ...
    def render(self, cost_nano: int) -> bytes: ...
    def chunk(self, payload: bytes) -> bytes: ...
    def finish(self, cost_nano: int) -> bytes: ...
    def truncate(self, note: str) -> bytes:
        """Frames that end the output as if at max_tokens (the money ran out), with a note."""

    def keepalive(self) -> bytes: ...
    def error(self, err: GatewayError) -> Reply: ...
    def stream_error(self, err: GatewayError) -> bytes: ...


def openai_error(err: GatewayError) -> Reply:
    """OpenAI's error shape; the 502 of the contract is plain text."""
    if err.plain:
        return Reply(err.status, err.message.encode(), "text/plain; charset=utf-8", dict(err.headers))
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return Reply(err.status, orjson.dumps(body), JSON, dict(err.headers))


def openai_stream_error(err: GatewayError) -> bytes:
    """An error after the 200: a data line the OpenAI SDKs raise on, then [DONE]."""
    body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    return b"data: " + orjson.dumps(body) + b"\n\ndata: [DONE]\n\n"


def as_bool(value: Any) -> bool | None:
    """The contract's lenient booleans: true/false, "true"/"false", 1/0; None if none of them."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return None

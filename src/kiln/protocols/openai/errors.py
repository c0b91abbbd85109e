"""OpenAI's error shapes, for every OpenAI-shaped endpoint (and the gateway's own routes)."""

from __future__ import annotations

import orjson

from kiln.core.errors import GatewayError
from kiln.protocols.base import JSON, Reply


def openai_error(err: GatewayError) -> Reply:
    """`{"error": {message, type, param, code}}`; the 502 of the contract is plain text."""
    if err.plain:
        return Reply(err.status, err.message.encode(), "text/plain; charset=utf-8", dict(err.headers))
    return Reply(err.status, orjson.dumps(_body(err)), JSON, dict(err.headers))


def openai_stream_error(err: GatewayError) -> bytes:
    """An error after the 200: a data line the OpenAI SDKs raise on, then [DONE]."""
    return b"data: " + orjson.dumps(_body(err)) + b"\n\ndata: [DONE]\n\n"


def _body(err: GatewayError) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}

"""What Chat Completions and legacy Completions share.

Both forward to an OpenAI-shaped backend endpoint and answer in (nearly) the
same shape, so both get: `stream` coerced to a boolean, usage always asked
of the upstream, the public model name, `usage.cost` on JSON and on the
usage chunk, the usage chunk removed unless the client asked for it, chunks
passed through as bytes unless an enforcement (stop strings, ...) needs to
look inside, and OpenAI error shapes. A subclass validates its own request
and says how to enforce inside a parsed chunk.
"""

from __future__ import annotations

from typing import Any

import orjson

from kiln.catalog import Backend, Catalog, Model
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.money import nano_to_usd_str
from kiln.core.records import Usage
from kiln.protocols.base import Reply, as_bool, openai_error, openai_stream_error
from kiln.upstream import in_stream_error

DONE = b"data: [DONE]\n\n"


def cost_fragment(cost_nano: int) -> orjson.Fragment:
    """usage.cost as an exact decimal JSON number (no float rounding)."""
    return orjson.Fragment(nano_to_usd_str(cost_nano).encode())


class OpenAITranslator:
    endpoint = ""
    upstream_path = ""
    chunk_object = ""  # "object" of the stream chunks Kiln builds itself

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.stream = False
        self.include_usage = False
        self.usage = Usage()
        self.chunks = 0
        self.done = False
        self.model: Model
        self._body: dict[str, Any] = {}
        self._data: dict[str, Any] = {}
        self._usage_chunk: dict[str, Any] | None = None
        self._model_from = b""
        self._model_to = b""
        self._stream_id = ""  # of the chunks seen, for chunks Kiln builds itself
        self._created = 0

    # -- for subclasses ---------------------------------------------------------

    def _parse_chunks(self) -> bool:
        """True when an enforcement needs every chunk parsed (else bytes pass through)."""
        return False

    def _chunk_parsed(self, data: dict[str, Any]) -> bytes:
        """Enforce inside one parsed chunk (usage already taken, model already public)."""
        return self._emit(data, data.get("choices") or [])

    def _stream_options(self, body: dict[str, Any]) -> bool:
        """Coerce `stream`, check `stream_options`, and ask the upstream for usage."""
        stream = as_bool(body.get("stream", False))
        if stream is None:
            raise errors.invalid("'stream' must be a boolean (true or false).", param="stream")
        self.stream = body["stream"] = stream
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise errors.invalid("'stream_options' is only allowed with 'stream': true.", param="stream_options")
            if not isinstance(options, dict):
                raise errors.invalid("'stream_options' must be an object.", param="stream_options")
            self.include_usage = as_bool(options.get("include_usage", False)) is True
        if stream:
            body["stream_options"] = {**(options or {}), "include_usage": True}
        return stream

    # -- request ----------------------------------------------------------------

    def upstream_body(self, backend: Backend) -> bytes:
        self._body["model"] = backend.model
        if backend.model != self.model.id:
            self._model_from = b'"model":' + orjson.dumps(backend.model)
            self._model_to = b'"model":' + orjson.dumps(self.model.id)
        return orjson.dumps(self._body)

    # -- JSON response ------------------------------------------------------------

    def _load_response(self, raw: bytes) -> dict[str, Any]:
        """The backend's JSON with the public model name and its usage taken."""
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise errors.bad_gateway("The model backend returned a malformed response.")
        data["model"] = self.model.id
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage.from_openai(usage)
        else:
            data["usage"] = {}
        self._data = data
        return data

    def render(self, cost_nano: int) -> bytes:
        usage = self._data["usage"]
        if not usage:
            usage.update(self._counts())
        usage["cost"] = cost_fragment(cost_nano)
        return orjson.dumps(self._data)

    # -- stream -------------------------------------------------------------------

    def chunk(self, payload: bytes) -> bytes:
        if payload == b"[DONE]":
            self.done = True
            return b""
        if payload.startswith(b'{"error"'):
            raise in_stream_error(orjson.loads(payload))
        if self._parse_chunks():
            data = orjson.loads(payload)
            if self._take_usage(data):
                return b""
            data.pop("usage", None)
            data["model"] = self.model.id
            self._stream_id = data.get("id", self._stream_id)
            self._created = data.get("created", self._created)
            return self._chunk_parsed(data)
        if b'"usage"' in payload and self._take_usage(orjson.loads(payload)):
            return b""
        if not self.chunks:  # the first chunk names the stream
            head = orjson.loads(payload)
            self._stream_id, self._created = head.get("id", ""), head.get("created", 0)
        self.chunks += 1
        if self._model_from:
            payload = payload.replace(self._model_from, self._model_to, 1)
        return b"data: " + payload + b"\n\n"

    def _take_usage(self, data: dict[str, Any]) -> bool:
        """Record usage from a chunk; True if it is the usage-only chunk (sent at the end, or not)."""
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage = Usage.from_openai(usage)
            if not data.get("choices"):
                self._usage_chunk = data
                return True
        return False

    def _emit(self, data: dict[str, Any], choices: list[dict[str, Any]]) -> bytes:
        """A parsed chunk back to bytes, with only the choices that still say something."""
        if not choices and data.get("choices"):
            return b""
        self.chunks += 1
        data["choices"] = choices
        return b"data: " + orjson.dumps(data) + b"\n\n"

    def finish(self, cost_nano: int) -> bytes:
        if not self.include_usage:
            return DONE
        chunk = self._usage_chunk or {
            "id": self._stream_id, "object": self.chunk_object, "created": self._created, "choices": []
        }
        chunk["model"] = self.model.id
        usage = chunk.setdefault("usage", {})
        if not usage or not self.usage.exact:
            usage.update(self._counts())
        usage["cost"] = cost_fragment(cost_nano)
        return b"data: " + orjson.dumps(chunk) + b"\n\n" + DONE

    def _truncated(self, choices: list[dict[str, Any]], note: str) -> bytes:
        chunk = {"id": self._stream_id, "object": self.chunk_object, "created": self._created,
                 "model": self.model.id, "choices": choices, "kiln_note": note}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def keepalive(self) -> bytes:
        return b": keepalive\n\n"

    def error(self, err: GatewayError) -> Reply:
        return openai_error(err)

    def stream_error(self, err: GatewayError) -> bytes:
        return openai_stream_error(err)

    def _counts(self) -> dict[str, int]:
        u = self.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens}

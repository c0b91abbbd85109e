"""What Chat Completions and legacy Completions share: the backend already speaks them.

Both forward to the same-shaped backend endpoint, so the answer is nearly
the backend's own: the model name the client sent, `usage.cost` on JSON and
on the usage chunk, the usage chunk removed unless the client asked for it.
Streamed chunks pass through as bytes (no parse, no re-encode) unless an
enforcement (stop strings, one tool call per reply) needs to look inside; a
subclass validates its own request and enforces inside parsed chunks.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import orjson

from kiln.core import errors
from kiln.core.money import nano_to_usd_str
from kiln.core.records import Usage
from kiln.protocols.base import Context, Run, Step, as_bool
from kiln.protocols.chat_backed import ChatBacked, backend_json, choices_of, malformed

DONE = b"data: [DONE]\n\n"


def cost_fragment(cost_nano: int) -> orjson.Fragment:
    """usage.cost as an exact decimal JSON number (no float rounding)."""
    return orjson.Fragment(nano_to_usd_str(cost_nano).encode())


def _finish_in(payload: bytes) -> str | None:
    """The finish reason of a chunk seen as bytes (no parse: pass-through streams)."""
    start = payload.find(b'"finish_reason":"') + len(b'"finish_reason":"')
    end = payload.find(b'"', start)
    return payload[start:end].decode() if end > start else None


_JOIN = b"\n\ndata: "
_OBJECTS = b"}" + _JOIN + b"{"  # a boundary between two JSON objects
_USAGE = b'"usage"'
_ERROR = b'{"error"'
_FINISH = b'"finish_reason":"'


def _objects(payloads: list[bytes], start: int, end: int) -> int:
    """How many payloads from `start` (before `end`) are JSON objects, up to the first that is not."""
    i = start
    while i < end and payloads[i][:1] == b"{" and payloads[i][-1:] == b"}":
        i += 1
    return i - start


def usage_counts(u: Usage) -> dict[str, Any]:
    counts: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                              "total_tokens": u.prompt_tokens + u.completion_tokens}
    if u.cached_tokens:
        counts["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return counts


class Passthrough(ChatBacked):
    chunk_object: ClassVar[str] = ""  # "object" of the stream chunks Kiln builds itself
    empty_piece: ClassVar[tuple[bytes, ...]] = ()  # byte patterns of a chunk that carries no output

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.include_usage = False
        self._data: dict[str, Any] = {}  # the JSON answer
        self._reported: Usage | None = None  # the usage the backend reported
        self._usage_chunk: dict[str, Any] | None = None  # the backend's usage-only chunk, held back
        self._chunk_usage: Usage | None = None  # what it reported
        self._named = False  # the first chunk was seen (stream id, created, model rewrite)
        self._model_from = b""
        self._model_to = b""
        self._stream_id = ""
        self._created = 0

    # -- for subclasses ---------------------------------------------------------

    def _parses(self) -> bool:
        """True when an enforcement needs every chunk parsed (else bytes pass through)."""
        return False

    @abstractmethod
    def _enforce(self, data: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """Enforce inside one parsed chunk: the choices still to send, and whether the output ended."""

    @abstractmethod
    def _enforce_json(self, data: dict[str, Any]) -> None:
        """Enforce inside the JSON answer, in place."""

    def _stream_options(self, body: dict[str, Any]) -> bool:
        """Coerce `stream`, check `stream_options`, and always ask the upstream for usage."""
        stream = as_bool(body.get("stream", False))
        if stream is None:
            raise errors.invalid("'stream' must be a boolean (true or false).", param="stream")
        body["stream"] = stream
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

    # -- JSON answer --------------------------------------------------------------

    def _response(self, data: dict[str, Any]) -> Usage | None:
        data["model"] = self.name
        self._reported = Usage.from_openai(data.get("usage"))
        self._data = data
        self._enforce_json(data)
        choices = data.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            self._note_finish(choices[0].get("finish_reason"))
        return self._reported

    def render(self, usage: Usage, cost_nano: int) -> bytes:
        data = self._data
        reported = data.get("usage") if usage is self._reported else None
        data["usage"] = {**(reported if isinstance(reported, dict) else usage_counts(usage)),
                         "cost": cost_fragment(cost_nano)}
        return orjson.dumps(data)

    # -- stream -------------------------------------------------------------------

    def _chunk(self, payload: bytes) -> Step:
        if self._parses():
            return self._parsed(backend_json(payload))
        if payload[:1] != b"{" or payload[-1:] != b"}":  # not a JSON object: garbage from the backend
            raise malformed()
        usage = None
        # find() rather than `in`: on bytes, `in` first tries its operand as an integer and raises
        # and clears a TypeError (about 2,000 instructions), several times a stream
        if payload.find(b'"usage"') >= 0:
            data = backend_json(payload)
            usage = Usage.from_openai(data.get("usage"))
            if not choices_of(data):  # the usage chunk: held back for finish()
                self._usage_chunk, self._chunk_usage = data, usage
                return b"", usage, 0, False
            if "usage" in data:  # usage riding on a content chunk (llama.cpp's completions): the client
                self._hold_usage(data)  # sees usage only in the usage chunk, and only if it asked
                payload = orjson.dumps(data)
        if not self._named:
            self._name_stream(backend_json(payload))
        if self._model_from:
            payload = payload.replace(self._model_from, self._model_to, 1)
        if self._finish_reason is None and payload.find(b'"finish_reason":"') >= 0:
            self._note_finish(_finish_in(payload))
        pieces = 1
        for pattern in self.empty_piece:  # a plain loop: any() over a generator costs more than the test
            if payload.find(pattern) >= 0:
                pieces = 0
                break
        return b"data: " + payload + b"\n\n", usage, pieces, False

    def chunks(self, payloads: list[bytes], start: int, most: int) -> Run | None:
        """Mid-stream, bytes passing through: the run joined once, then a few scans of the joined
        bytes (in C) find where it must stop, instead of a look at each payload in Python: before
        the first usage, error or (while no output has ended) finish reason, and before the first
        payload that is not a JSON object. JSON escapes every quote inside a string, so these
        markers can only be the chunk's own keys, never text the model wrote."""
        if not self._named or self._parses():
            return None
        stop = min(len(payloads), start + most)
        if stop - start < 2:
            return None
        first = payloads[start]
        if first.find(_USAGE) >= 0 or first[:1] != b"{" or (self._finish_reason is None and first.find(_FINISH) >= 0):
            return None  # the run would end before its first payload (the finish or usage chunk, the end)
        raw = _JOIN.join(payloads[start:stop])
        cut = len(raw)
        for marker in (_USAGE, _ERROR, _FINISH) if self._finish_reason is None else (_USAGE, _ERROR):
            at = raw.find(marker, 0, cut)
            if at >= 0:
                cut = raw.rfind(_JOIN, 0, at)  # the boundary before the payload that holds it
                if cut < 0:
                    return None
        if cut < len(raw):
            raw = raw[:cut]
        taken = raw.count(_JOIN) + 1
        if raw.count(_OBJECTS) != taken - 1 or raw[:1] != b"{" or raw[-1:] != b"}":
            taken = _objects(payloads, start, start + taken)  # rare: [DONE] or garbage in the run
            raw = _JOIN.join(payloads[start:start + taken])
        if taken < 2:
            return None
        if self._model_from:
            raw = raw.replace(self._model_from, self._model_to)
        pieces = taken
        for pattern in self.empty_piece:
            pieces -= raw.count(pattern)
        return b"data: " + raw + b"\n\n", None, pieces, taken

    def _parsed(self, data: dict[str, Any]) -> Step:
        usage = Usage.from_openai(data["usage"]) if "usage" in data else None
        choices = choices_of(data)
        if not choices and usage is not None:
            self._usage_chunk, self._chunk_usage = data, usage
            return b"", usage, 0, False
        if "usage" in data:
            self._hold_usage(data)
        if not self._named:
            self._name_stream(data)
        data["model"] = self.name
        keep, ended = self._enforce(data)
        for choice in keep:
            self._note_finish(choice.get("finish_reason"))
        if not keep and choices:
            return b"", usage, 0, ended
        data["choices"] = keep
        return b"data: " + orjson.dumps(data) + b"\n\n", usage, 1, ended

    def _hold_usage(self, data: dict[str, Any]) -> None:
        """Take the usage off a content chunk, kept as the usage chunk finish() would send."""
        usage = data.pop("usage")
        if isinstance(usage, dict):
            self._usage_chunk = {"id": data.get("id", ""), "object": self.chunk_object,
                                 "created": data.get("created", 0), "choices": [], "usage": usage}
            self._chunk_usage = Usage.from_openai(usage)

    def _note_finish(self, reason: Any) -> None:
        if self._finish_reason is None and isinstance(reason, str):
            self._finish_reason = reason

    def _name_stream(self, head: dict[str, Any]) -> None:
        """The first chunk names the stream (for chunks Kiln builds) and the backend's model name."""
        self._named = True
        self._stream_id = str(head.get("id") or "")
        created = head.get("created")
        self._created = created if isinstance(created, int) else 0
        backend_model = head.get("model")
        if isinstance(backend_model, str) and backend_model != self.name:
            self._model_from = b'"model":' + orjson.dumps(backend_model)
            self._model_to = b'"model":' + orjson.dumps(self.name)

    def finish(self, usage: Usage, cost_nano: int) -> bytes:
        if not self.include_usage:
            return DONE
        chunk = self._usage_chunk
        if chunk is None or usage is not self._chunk_usage:  # billed from an estimate: say what was billed
            chunk = {"id": self._stream_id, "object": self.chunk_object, "created": self._created, "choices": [],
                     "usage": usage_counts(usage)}
        chunk["model"] = self.name
        chunk["usage"] = {**chunk["usage"], "cost": cost_fragment(cost_nano)}
        return b"data: " + orjson.dumps(chunk) + b"\n\n" + DONE

    def _truncated(self, choices: list[dict[str, Any]], note: str) -> bytes:
        self._finish_reason = "length"
        chunk = {"id": self._stream_id, "object": self.chunk_object, "created": self._created,
                 "model": self.name, "choices": choices, "kiln_note": note}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

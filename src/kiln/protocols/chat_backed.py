"""The upstream side every translator shares: an OpenAI-shaped backend.

Every client protocol is served by a backend's chat completions (or, for
legacy completions, its completions) endpoint, so what happens on that side
is the same for all of them and lives here once: the model lookup and the
name the client used (echoed back in every answer), the lenient `stream`
flag, the `[DONE]` and in-stream error payloads, and reading the backend's
JSON defensively. A backend answer of the wrong shape is the backend's fault
(502); anything else that goes wrong in a translator is ours (the pipeline
logs it and answers 500), so the checks here are explicit rather than a
blanket `except`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import orjson

from kiln.catalog import Model
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.records import Usage
from kiln.protocols.base import Context, Reply, Run, Step, as_bool
from kiln.protocols.openai.errors import openai_error, openai_stream_error
from kiln.upstream import END_OF_STREAM, in_stream_error

MALFORMED = "The model backend returned a malformed response."
_DONE: Step = (b"", None, 0, True)


def malformed() -> GatewayError:
    err = errors.bad_gateway(MALFORMED)
    err.backend, err.outcome = True, "error"
    return err


def backend_json(raw: bytes) -> dict[str, Any]:
    """A backend's JSON object, or the 502 that says it sent something else."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise malformed() from None
    if not isinstance(data, dict):
        raise malformed()
    return data


def choices_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    choices = data.get("choices")
    if choices is None:
        return []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise malformed()
    return choices


def part_of(choice: dict[str, Any], name: str) -> dict[str, Any]:
    """A choice's `message` or `delta`: an object, empty when absent."""
    part = choice.get(name)
    if part is None:
        return {}
    if not isinstance(part, dict):
        raise malformed()
    return part


def text_of(part: dict[str, Any], *names: str) -> str:
    """The first non-empty string among `names` (e.g. `reasoning`, then `reasoning_content`)."""
    for name in names:
        value = part.get(name)
        if isinstance(value, str) and value:
            return value
        if value is not None and not isinstance(value, str):
            raise malformed()
    return ""


def tool_calls_of(part: dict[str, Any]) -> list[dict[str, Any]]:
    """Tool-call entries, each with a `function` object (empty when absent)."""
    calls = part.get("tool_calls")
    if not calls:
        return []
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise malformed()
    for call in calls:
        fn = call.get("function")
        if fn is None:
            call["function"] = {}
        elif not isinstance(fn, dict) or not all(
            v is None or isinstance(v, str) for v in (fn.get("name"), fn.get("arguments"))
        ):
            raise malformed()
    return calls


def lookup_model(ctx: Context, body: Any) -> tuple[Model, str]:
    """The catalog model a request names, and the name as the client sent it (an id or an alias)."""
    if not isinstance(body, dict):
        raise errors.invalid("The request body must be a JSON object.")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise errors.invalid("'model' is required: a model ID from GET /v1/models.", param="model")
    model = ctx.catalog.get(name)
    if model is None:
        raise errors.not_found(
            f"The model '{name}' does not exist or is not served here. GET /v1/models lists the IDs.",
            code="model_not_found",
            param="model",
        )
    return model, name


def stream_flag(body: dict[str, Any]) -> bool:
    """`stream` as a JSON boolean; the contract also reads "true" and 1."""
    stream = as_bool(body.get("stream", False))
    if stream is None:
        raise errors.invalid("'stream' must be a boolean (true or false).", param="stream")
    return stream


class ChatBacked(ABC):
    """Shared upstream side; a protocol implements `request`, `_chunk`, `_response` and its output."""

    endpoint: ClassVar[str] = ""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.name = ""  # the model name the client sent, echoed in every answer
        self._finish_reason: str | None = None  # the first output's, in chat terms

    def chunk(self, payload: bytes) -> Step:
        if payload == END_OF_STREAM:
            return _DONE
        if payload.startswith(b'{"error"'):
            raise in_stream_error(backend_json(payload))
        return self._chunk(payload)

    def chunks(self, payloads: list[bytes], start: int, most: int) -> Run | None:
        """Several payloads of a read at once, from `start`: the longest run of them, `most` at
        most, that holds nothing but output (no end, no error, no usage of the held-back kind),
        as (frames, the latest usage among them, output pieces, how many), which is what `chunk`
        would give for each, joined; it advances the translator as those calls would. None: take
        the next one by one. It looks at no payload beyond the run and one past it, so going
        through a read costs what the read is long (`most` lets the caller stop at a budget)."""
        return None

    def response(self, raw: bytes) -> Usage | None:
        return self._response(backend_json(raw))

    @abstractmethod
    def _chunk(self, payload: bytes) -> Step:
        """One upstream stream payload that is neither `[DONE]` nor an error."""

    @abstractmethod
    def _response(self, data: dict[str, Any]) -> Usage | None:
        """The backend's JSON answer (an object); the usage it reported, if any."""

    def finish_reason(self) -> str | None:
        """How the first output ended, in chat-completions terms (stop, length, tool_calls, ...)."""
        return self._finish_reason

    def keepalive(self) -> bytes:
        return b": keepalive\n\n"

    def error(self, err: GatewayError) -> Reply:
        return openai_error(err)

    def stream_error(self, err: GatewayError) -> bytes:
        return openai_stream_error(err)

"""OpenAI Responses API (stateless), translated to chat completions.

The request side lives in responses_input.py, the items and the event
state machine in responses_output.py, the reasoning blob in
responses_reasoning.py; this module is the translator the pipeline drives.
Metering is chat's: the backend is asked for usage the same way, so the same
tokens cost the same. Per the contract, Responses output (JSON and events)
carries token counts without a cost field; the X-Neocloud-Generation-Id
header names the usage event that holds the cost.

Two Codex needs shape the stream beyond the event order: a context overflow
is a `response.failed` with code `context_length_exceeded` (Codex trims
its history on that code; an HTTP 400 would end the session), and keepalives
are `response.in_progress` events, because Codex's idle timer only resets on
an SSE event with data, never on a comment.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import orjson

from kiln.catalog import Backend, Catalog
from kiln.config import Settings
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.records import Usage
from kiln.protocols.base import SSE, Reply, as_bool, openai_error
from kiln.protocols.openai.chat import lookup_model
from kiln.protocols.openai.passthrough import cost_fragment
from kiln.protocols.openai.responses_input import MappedRequest, map_request
from kiln.protocols.openai.responses_output import EventStream, Items, new_id
from kiln.protocols.openai.responses_reasoning import ReasoningSeal, reasoning_key
from kiln.upstream import in_stream_error

OVERFLOW = "context_length_exceeded"


class ResponsesTranslator:
    endpoint = "responses"
    upstream_path = "/chat/completions"
    seal: ReasoningSeal | None = None  # bound to the gateway's key by responses_protocol()

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.stream = False
        self.usage = Usage()
        self.chunks = 0
        self.done = False
        self._id = new_id("resp_")
        self._created = int(time.time())
        self._mapped = MappedRequest({})
        self._items = Items(frozenset(), None, False)
        self._events: EventStream | None = None
        self._output: list[dict[str, Any]] = []
        self._finish_reason: str | None = None
        self._note = ""

    # -- request ----------------------------------------------------------

    def request(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise errors.invalid("The request body must be a JSON object.")
        self.model = lookup_model(self.catalog, body)
        stream = as_bool(body.get("stream", False))
        if stream is None:
            raise errors.invalid("'stream' must be a boolean (true or false).", param="stream")
        self.stream = stream
        self._mapped = mapped = map_request(body, self.model, self.seal)
        chat = mapped.body
        chat["stream"] = stream
        if stream:
            chat["stream_options"] = {"include_usage": True}
        self._items = Items(mapped.custom_tools, self.seal if mapped.encrypted_reasoning else None, mapped.summary)
        self._events = EventStream(self._items, self._snapshot, mapped.single_tool_call)
        return chat

    def upstream_body(self, backend: Backend) -> bytes:
        self._mapped.body["model"] = backend.model
        return orjson.dumps(self._mapped.body)

    # -- JSON response ----------------------------------------------------

    def response(self, raw: bytes) -> None:
        data = orjson.loads(raw)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices or not isinstance(choices[0], dict):
            raise errors.bad_gateway("The model backend returned a malformed response.")
        self._output = self._items.from_message(choices[0].get("message") or {}, self._mapped.single_tool_call)
        self._finish_reason = choices[0].get("finish_reason")
        if isinstance(data.get("usage"), dict):
            self.usage = Usage.from_openai(data["usage"])

    def render(self, cost_nano: int) -> bytes:
        """The JSON response carries usage.cost like every OpenAI-shaped JSON body; the stream
        events carry token counts only (the contract)."""
        status, details, _ = self._outcome(streaming=False)
        usage = {**self._usage(), "cost": cost_fragment(cost_nano)}
        return orjson.dumps(self._snapshot(status=status, incomplete_details=details, output=self._output,
                                           usage=usage))

    # -- stream -----------------------------------------------------------

    def chunk(self, payload: bytes) -> bytes:
        if payload == b"[DONE]":
            self.done = True
            return b""
        if payload.startswith(b'{"error"'):
            raise in_stream_error(orjson.loads(payload))
        data = orjson.loads(payload)
        if isinstance(data.get("usage"), dict):
            self.usage = Usage.from_openai(data["usage"])
        choices = data.get("choices")
        if not choices:
            return b""
        self.chunks += 1
        assert self._events is not None
        return self._events.feed(choices[0])

    def finish(self, cost_nano: int) -> bytes:
        """Close the last item and end with the final response (token counts, no cost)."""
        events = self._events
        assert events is not None
        self._finish_reason = events.finish_reason
        out = events.start() + events.close()
        status, details, error = self._outcome(streaming=True)
        final = self._snapshot(status=status, incomplete_details=details, error=error, output=events.output,
                               usage=self._usage())
        if self._note:
            final["kiln_note"] = self._note
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return out + events.event(kind, response=final)

    def truncate(self, note: str) -> bytes:
        """The money ran out: end as at max tokens; finish() sends response.incomplete with the note."""
        assert self._events is not None
        self._events.finish_reason = "length"
        self._note = note
        return b""

    def keepalive(self) -> bytes:
        assert self._events is not None
        return self._events.keepalive()

    def error(self, err: GatewayError) -> Reply:
        """An overflow on a streamed request is a 200 stream ending in response.failed, for Codex."""
        if self.stream and self._events is not None and err.code == OVERFLOW:
            return Reply(200, self.stream_error(err), SSE)
        return openai_error(err)

    def stream_error(self, err: GatewayError) -> bytes:
        """After the 200: response.failed, never a clean completion."""
        events = self._events
        assert events is not None
        code = OVERFLOW if err.code == OVERFLOW else "server_error"
        final = self._snapshot(status="failed", error={"code": code, "message": err.message}, output=events.output,
                               usage=self._usage() if self.usage.exact else None)
        return events.start() + events.event("response.failed", response=final)

    # -- shaping ----------------------------------------------------------

    def _snapshot(self, **override: Any) -> dict[str, Any]:
        """The response object; the stream's skeleton until `override` fills it in."""
        return {
            "id": self._id, "object": "response", "created_at": self._created, "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, **self._mapped.echo,
            "model": self.model.id, "output": [], "previous_response_id": None, "service_tier": "default",
            "store": False, "truncation": "disabled", "usage": None, "user": None, **override,
        }

    def _outcome(self, streaming: bool) -> tuple[str, dict[str, str] | None, dict[str, str] | None]:
        """status, incomplete_details and error from how the generation ended."""
        reason = self._finish_reason
        if reason == "length":
            u = self.usage
            if (streaming and self._mapped.max_output_tokens is None
                    and u.prompt_tokens + u.completion_tokens >= self.model.context_window):
                message = f"The conversation filled the model's context window ({self.model.context_window} tokens)."
                return "failed", None, {"code": OVERFLOW, "message": message}
            return "incomplete", {"reason": "max_output_tokens"}, None
        if reason == "content_filter":
            return "incomplete", {"reason": "content_filter"}, None
        return "completed", None, None

    def _usage(self) -> dict[str, Any]:
        u = self.usage
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }


@functools.lru_cache(maxsize=4)
def _bound(key: bytes) -> type[ResponsesTranslator]:
    return type("ResponsesTranslator", (ResponsesTranslator,), {"seal": ReasoningSeal(key)})


def responses_protocol(settings: Settings) -> type[ResponsesTranslator]:
    """The translator class for this gateway: its reasoning blobs use the gateway's key."""
    return _bound(reasoning_key(settings.reasoning_secret, settings.data_dir))

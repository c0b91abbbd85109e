"""OpenAI Responses API (stateless), translated to chat completions.

The request side lives in responses_input.py, the items and the event
state machine in responses_output.py, the reasoning blob in
protocols/reasoning.py; this module is the translator the pipeline drives.
Metering is chat's: the backend is asked for usage the same way, so the same
tokens cost the same. The JSON answer carries `usage.cost` like every
OpenAI-shaped JSON body; the stream events carry token counts only (the
contract); the X-Neocloud-Generation-Id header names the usage event.

Two Codex needs shape the stream beyond the event order: a context overflow
is a `response.failed` with code `context_length_exceeded` (Codex trims
its history on that code; an HTTP 400 would end the session), and keepalives
are events with data, because Codex's idle timer only resets on those, never
on an SSE comment.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from kiln.core.errors import GatewayError
from kiln.core.records import Usage
from kiln.protocols.base import SSE, Context, Reply, Run, Step, UpstreamCall, new_id
from kiln.protocols.chat_backed import (
    ChatBacked, backend_json, choices_of, lookup_model, malformed, part_of, stream_flag,
)
from kiln.protocols.openai.errors import openai_error
from kiln.protocols.openai.passthrough import cost_fragment
from kiln.protocols.openai.responses_input import MappedRequest, map_request
from kiln.protocols.openai.responses_output import EventStream, Items
from kiln.protocols.text_runs import TextRuns

OVERFLOW = "context_length_exceeded"
# The response object, written from bytes: the request's echoed fields are encoded once, and the
# same skeleton serves the JSON answer, the stream's head and its final event.
_RESPONSE = (b'{"id":"%b","object":"response","created_at":%d,"status":"%b","background":false,"error":%b,'
             b'"incomplete_details":%b%b,"model":%b,"output":%b,"previous_response_id":null,'
             b'"service_tier":"default","store":false,"truncation":"disabled","usage":%b,"user":null%b}')


class ResponsesTranslator(ChatBacked):
    endpoint = "responses"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.stream = False
        self._id = ""
        self._created = 0
        self._context_window = 0
        self._mapped = MappedRequest({})
        self._echo = b""  # the request fields the response repeats, encoded once (",member,...")
        self._items: Items | None = None
        self._events: EventStream | None = None
        self._output: list[dict[str, Any]] = []
        self._note = ""
        self._runs = TextRuns()

    # -- request ----------------------------------------------------------

    def request(self, body: Any) -> UpstreamCall:
        model, self.name = lookup_model(self.ctx, body)
        self._context_window = model.context_window
        self.stream = stream = stream_flag(body)
        self._mapped = mapped = map_request(body, model, self.ctx.seal)
        # Encoded now, once: every event and the final object repeat them, and a field nested too
        # deeply to re-encode is refused before anything is generated (the pipeline's 400).
        members = orjson.dumps(mapped.echo)[1:-1]
        self._echo = b"," + members if members else b""
        self._id, self._created = new_id("resp_"), int(time.time())
        chat = mapped.body
        chat["stream"] = stream
        if stream:
            chat["stream_options"] = {"include_usage": True}
        self._items = Items(mapped.custom_tools, self.ctx.seal if mapped.encrypted_reasoning else None,
                            mapped.summary, mapped.namespaced)
        if stream:
            self._events = EventStream(self._items, self._snapshot(), mapped.single_tool_call)
        cap = chat.get("max_tokens", model.max_output_tokens)
        return UpstreamCall(model, "/chat/completions", chat, stream, cap)

    # -- JSON answer ----------------------------------------------------

    def _response(self, data: dict[str, Any]) -> Usage | None:
        choices = choices_of(data)
        if not choices:
            raise malformed()
        assert self._items is not None
        self._output = self._items.from_message(part_of(choices[0], "message"), self._mapped.single_tool_call)
        reason = choices[0].get("finish_reason")
        self._finish_reason = reason if isinstance(reason, str) else None
        return Usage.from_openai(data.get("usage"))

    def render(self, usage: Usage, cost_nano: int) -> bytes:
        """The JSON answer carries usage.cost like every OpenAI-shaped JSON body; the stream
        events carry token counts only (the contract)."""
        status, details, _ = self._outcome(usage, streaming=False)
        counts = {**_usage(usage), "cost": cost_fragment(cost_nano)}
        return self._snapshot(status, incomplete_details=details, output=self._output, usage=counts)

    # -- stream -----------------------------------------------------------

    def _chunk(self, payload: bytes) -> Step:
        events = self._events
        if events is not None and events.started:  # a plain text delta read alone (a paced stream's every read)
            one = self._runs.one(payload)
            if one is not None:
                field, body, usage = one
                return events.text_run([(field, [body])]), usage, 1, False
        data = backend_json(payload)
        usage = Usage.from_openai(data["usage"]) if "usage" in data else None
        choices = choices_of(data)
        if not choices:
            return b"", usage, 0, False
        assert events is not None
        out, said = events.feed(choices[0], part_of(choices[0], "delta"))
        if said:
            self._runs.learn(payload, data)
        return out, usage, 1 if said else 0, False

    def chunks(self, payloads: list[bytes], start: int, most: int) -> Run | None:
        """Mid-stream, a run of plain text deltas (protocols/text_runs.py) in one tight loop,
        each still its own event with its own sequence number."""
        events = self._events
        if events is None or not events.started:
            return None
        groups, usage, taken = self._runs.take(payloads, start, most)
        if not taken:
            return None
        return events.text_run(groups), usage, taken, taken

    def finish(self, usage: Usage, cost_nano: int) -> bytes:
        """Close the last item and end with the final response (token counts, no cost)."""
        events = self._events
        assert events is not None
        self._finish_reason = events.finish_reason
        out = events.start() + events.close()
        status, details, error = self._outcome(usage, streaming=True)
        final = self._snapshot(status, incomplete_details=details, error=error, output=events.output,
                               usage=_usage(usage), note=self._note)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return out + events.final(kind, final)

    def truncate(self, note: str) -> bytes:
        """The money ran out: end as at max tokens; finish() sends response.incomplete with the note."""
        assert self._events is not None
        self._events.finish_reason = "length"
        self._note = note
        return b""

    def keepalive(self) -> bytes:
        """After the head, an in_progress event that carries only the fields that identify the
        response (made here: most streams never wait long enough for one)."""
        assert self._events is not None
        return self._events.keepalive({"id": self._id, "object": "response", "created_at": self._created,
                                       "status": "in_progress", "model": self.name})

    def error(self, err: GatewayError) -> Reply:
        """An overflow on a streamed request is a 200 stream ending in response.failed, for Codex."""
        if self._events is not None and err.code == OVERFLOW:
            return Reply(200, self.stream_error(err), SSE)
        return openai_error(err)

    def stream_error(self, err: GatewayError) -> bytes:
        """After the 200: response.failed, never a clean completion."""
        events = self._events
        assert events is not None
        code = OVERFLOW if err.code == OVERFLOW else "server_error"
        final = self._snapshot("failed", error={"code": code, "message": err.message}, output=events.output)
        return events.start() + events.final("response.failed", final)

    # -- shaping ----------------------------------------------------------

    def _snapshot(self, status: str = "in_progress", *, error: dict[str, str] | None = None,
                  incomplete_details: dict[str, str] | None = None, output: list[Any] | None = None,
                  usage: dict[str, Any] | None = None, note: str = "") -> bytes:
        """The response object, encoded; the stream's skeleton until the keywords fill it in."""
        extra = b',"kiln_note":' + orjson.dumps(note) if note else b""
        return _RESPONSE % (self._id.encode(), self._created, status.encode(), _json(error), _json(incomplete_details),
                            self._echo, orjson.dumps(self.name), orjson.dumps(output) if output else b"[]",
                            _json(usage), extra)

    def _outcome(self, usage: Usage, streaming: bool) -> tuple[str, dict[str, str] | None, dict[str, str] | None]:
        """status, incomplete_details and error from how the generation ended."""
        reason = self._finish_reason
        if reason == "length":
            if (streaming and self._mapped.max_output_tokens is None
                    and usage.prompt_tokens + usage.completion_tokens >= self._context_window):
                message = f"The conversation filled the model's context window ({self._context_window} tokens)."
                return "failed", None, {"code": OVERFLOW, "message": message}
            return "incomplete", {"reason": "max_output_tokens"}, None
        if reason == "content_filter":
            return "incomplete", {"reason": "content_filter"}, None
        return "completed", None, None


def _json(value: dict[str, Any] | None) -> bytes:
    """An optional object of the response, encoded (most of them are null on most answers)."""
    return b"null" if value is None else orjson.dumps(value)


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }

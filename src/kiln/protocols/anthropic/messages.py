"""Anthropic Messages (POST /v1/messages) in front of a chat-completions backend.

The request is mapped by anthropic_request.py, the output blocks are built by
anthropic_blocks.py; this module ties them to the pipeline's translator
surface and owns what is specific to the wire format: the typed SSE
events around the blocks, stop reasons, usage in Anthropic's sense
(`input_tokens` excludes cache reads), and errors in Anthropic's shape with
the wording Claude Code acts on. Metering is the chat path's: the backend is
asked for usage the same way and `usage` holds the same counts, so the same
tokens cost the same; the body carries no cost field (seed).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kiln.catalog import Backend, Catalog, Model
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.records import Usage
from kiln.protocols.anthropic.blocks import Blocks, frame, new_id
from kiln.protocols.anthropic.request import build_chat, estimate_tokens
from kiln.protocols.base import JSON, Reply, as_bool
from kiln.protocols.openai.chat import lookup_model
from kiln.protocols.stop import StopMatcher, cut_at_stop
from kiln.upstream import in_stream_error, overflow_tokens

MIN_OUTPUT = 1024  # max_tokens asked for even when the (high) prompt estimate leaves less room
PING = frame("ping", {"type": "ping"})
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_LIMIT = re.compile(r"context length (?:is |of )(\d+)|context length \((\d+) tokens\)|context size \((\d+) tokens\)")
_ASKED = re.compile(r"too large: (\d+)|(\d+) tokens for the completion")
_PROMPT = re.compile(r"(\d+) tokens from the input")


class MessagesTranslator:
    endpoint = "messages"
    upstream_path = "/chat/completions"
    model: Model  # set by prompt(), before anything reads it

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.stream = False
        self.usage = Usage()
        self.chunks = 0
        self.done = False
        self.thinking = False
        self.stops: list[str] = []
        self.prompt_estimate = 0
        self._name = ""  # the model name the client sent, echoed back
        self._id = new_id("msg_")
        self._body: dict[str, Any] = {}
        self._blocks = Blocks(False)
        self._matcher: StopMatcher | None = None
        self._finish_reason: str | None = None
        self._stop_sequence: str | None = None
        self._started = False
        self._note: str | None = None  # why the gateway ended the output early

    # -- request ----------------------------------------------------------

    def prompt(self, body: Any) -> dict[str, Any]:
        """Validate and convert what decides the prompt (shared with count_tokens)."""
        if not isinstance(body, dict):
            raise errors.invalid("The request body must be a JSON object.")
        self.model = model = lookup_model(self.catalog, body)
        self._name = body["model"]
        chat, self.thinking = build_chat(body, model)
        self.prompt_estimate = estimate_tokens(chat)
        return chat

    def request(self, body: Any) -> dict[str, Any]:
        chat = self.prompt(body)
        model = self.model
        asked = body.get("max_tokens")
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
            raise errors.invalid("'max_tokens' is required: a positive integer.", param="max_tokens")
        stream = as_bool(body.get("stream", False))
        if stream is None:
            raise errors.invalid("'stream' must be a boolean (true or false).", param="stream")
        single = chat.pop("parallel_tool_calls", None) is False
        if single and model.capabilities.parallel_tool_calls:
            chat["parallel_tool_calls"] = False
        self._blocks = Blocks(self.thinking, single_tool_call=single)
        self.stops = chat.get("stop", [])
        self._matcher = StopMatcher(self.stops) if self.stops else None
        chat["max_tokens"] = self._clamp(asked)
        chat["stream"] = self.stream = stream
        if stream:
            # Continuous stats put the prompt size on the first chunk (for message_start) and keep
            # billing exact when a stop sequence or a leaving client ends the stream early.
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        self._body = chat
        return chat

    def _clamp(self, asked: int) -> int:
        """max_tokens that fits the context with the prompt, by estimate.

        Claude Code asks for 32k-128k; vLLM <= 0.16 and SGLang reject prompt +
        max_tokens > context (0.33 clamps by itself). An exact count costs a
        /tokenize round trip on every request for the rare case where the
        estimate is wrong; the estimate is high, and if the backend still
        refuses, the refusal reaches the client in the wording that makes
        Claude Code retry with a smaller max_tokens.
        """
        limit = min(asked, self.model.max_output_tokens)
        room = self.model.context_window - self.prompt_estimate
        return min(limit, max(room, MIN_OUTPUT))

    def upstream_body(self, backend: Backend) -> bytes:
        self._body["model"] = backend.model
        return orjson.dumps(self._body)

    # -- JSON response ----------------------------------------------------

    def response(self, raw: bytes) -> None:
        try:
            data = orjson.loads(raw)
            choice = data["choices"][0]
            message = choice["message"]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise errors.bad_gateway("The model backend returned a malformed response.") from None
        if isinstance(data.get("usage"), dict):
            self.usage = Usage.from_openai(data["usage"])
        self._choice(choice, message)

    def render(self, cost_nano: int) -> bytes:
        """The Message object; token counts only, no cost field (seed)."""
        return orjson.dumps({
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._name,
            "content": self._blocks.content(),
            "stop_reason": self._stop_reason(),
            "stop_sequence": self._stop_sequence,
            "usage": self._usage(),
        })

    # -- stream -----------------------------------------------------------

    def chunk(self, payload: bytes) -> bytes:
        if payload == b"[DONE]":
            self.done = True
            return b""
        data = orjson.loads(payload)
        if "error" in data:
            raise in_stream_error(data)
        if isinstance(data.get("usage"), dict):
            self.usage = Usage.from_openai(data["usage"])
        head = self._message_start()
        choices = data.get("choices")
        if choices:
            self.chunks += 1
            self._choice(choices[0], choices[0].get("delta") or {})
        return head + self._blocks.take()

    def finish(self, cost_nano: int) -> bytes:
        head = self._message_start()
        if self._matcher is not None:
            self._blocks.text(self._matcher.flush())  # the tail held back in case it began a stop sequence
        self._blocks.close()
        delta: dict[str, Any] = {"stop_reason": self._stop_reason(), "stop_sequence": self._stop_sequence}
        event: dict[str, Any] = {"type": "message_delta", "delta": delta, "usage": self._usage()}
        if self._note:
            event["kiln_note"] = self._note
        end = frame("message_delta", event) + frame("message_stop", {"type": "message_stop"})
        return head + self._blocks.take() + end

    def truncate(self, note: str) -> bytes:
        """The gateway ends the output (the money ran out): finish() reports max_tokens."""
        self._note = note
        return b""

    def keepalive(self) -> bytes:
        return PING

    def _message_start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        usage = {**self._usage(), "output_tokens": 0}
        message: dict[str, Any] = {"id": self._id, "type": "message", "role": "assistant", "model": self._name,
                                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        return frame("message_start", {"type": "message_start", "message": message})

    # -- shared by both forms ----------------------------------------------

    def _choice(self, choice: dict[str, Any], message: dict[str, Any]) -> None:
        """Feed one choice's message (JSON) or delta (stream) into the blocks."""
        blocks = self._blocks
        blocks.reasoning(message.get("reasoning") or message.get("reasoning_content") or "")
        text = message.get("content")
        if isinstance(text, str) and text:
            if self._matcher is not None:
                if self.stream:
                    text, hit = self._matcher.feed(text), self._matcher.matched
                else:
                    text, hit = cut_at_stop(text, self.stops)
                if hit is not None:
                    self._stop_sequence, self._finish_reason, self.done = hit, "stop", True
            blocks.text(text)
        for position, entry in enumerate(message.get("tool_calls") or ()):
            blocks.tool_call(entry if self.stream else {**entry, "index": position})  # JSON calls carry no index
        reason = choice.get("finish_reason")
        if reason and self._stop_sequence is None:
            self._finish_reason = reason
            stopped = choice.get("stop_reason")
            if isinstance(stopped, str) and stopped in self.stops:
                self._stop_sequence = stopped

    def _stop_reason(self) -> str:
        if self._note is not None or self._finish_reason == "length":
            return "max_tokens"
        if self._blocks.has_tool_use:
            return "tool_use"
        if self._stop_sequence is not None:
            return "stop_sequence"
        return "refusal" if self._finish_reason == "content_filter" else "end_turn"

    def _usage(self) -> dict[str, int]:
        u = self.usage
        return {
            "input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens,
        }

    # -- errors -------------------------------------------------------------

    def error(self, err: GatewayError) -> Reply:
        """Anthropic's error shape on every status, the 502 included (plain text is OpenAI-only)."""
        return Reply(err.status, orjson.dumps(self._error_body(err)), JSON, dict(err.headers))

    def stream_error(self, err: GatewayError) -> bytes:
        """After the 200: an `error` event and no message_stop, so no client takes it for a clean end."""
        return frame("error", self._error_body(err))

    def _error_body(self, err: GatewayError) -> dict[str, Any]:
        kind = ERROR_TYPES.get(err.status) or ("api_error" if err.status >= 500 else "invalid_request_error")
        message = err.message
        if err.code == "context_length_exceeded":
            message = self._overflow(message)
        return {"type": "error", "error": {"type": kind, "message": message}}

    def _overflow(self, message: str) -> str:
        """A backend's context-overflow message in the two wordings Claude Code acts on.

        "prompt is too long" makes it compact the conversation; "input length
        and `max_tokens` exceed context limit" makes it retry with a smaller
        max_tokens. Any other wording makes it retry the same request.
        """
        limit = _number(_LIMIT, message) or self.model.context_window
        prompt = overflow_tokens(message) or _number(_PROMPT, message)
        asked = _number(_ASKED, message)
        if asked is not None and prompt is not None and prompt < limit:
            return (f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > {limit}, "
                    "decrease input length or `max_tokens` and try again")
        return f"prompt is too long: {prompt or max(self.prompt_estimate, limit + 1)} tokens > {limit} maximum"


def _number(pattern: re.Pattern[str], text: str) -> int | None:
    m = pattern.search(text)
    return int(next(g for g in m.groups() if g)) if m else None

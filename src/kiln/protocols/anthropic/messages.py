"""Anthropic Messages (POST /v1/messages) in front of a chat-completions backend.

The request is mapped by anthropic/request.py, the output blocks are built by
anthropic/blocks.py; this module is the translator the pipeline drives and
owns what is specific to the wire format: the typed SSE events around the
blocks (`message_start` first, always), stop reasons, usage in Anthropic's
sense (`input_tokens` excludes cache reads), and errors in Anthropic's shape
with the wording Claude Code acts on. The same tokens cost the same as on
chat; the body carries no cost field (seed).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kiln.catalog import Model
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.records import Usage
from kiln.protocols import capabilities
from kiln.protocols.anthropic.blocks import Blocks
from kiln.protocols.anthropic.request import Prompt, build_chat, estimate_tokens
from kiln.protocols.base import (
    JSON, Context, Reply, Run, Step, UpstreamCall, new_id, positive_int, sse_event,
)
from kiln.protocols.chat_backed import (
    ChatBacked, backend_json, choices_of, lookup_model, malformed, part_of, stream_flag, text_of,
    tool_calls_of,
)
from kiln.protocols.stop import StopMatcher, cut_at_stop
from kiln.protocols.text_runs import TextRuns
from kiln.upstream import overflow_tokens

MIN_OUTPUT = 1024  # max_tokens asked for even when the (high) prompt estimate leaves less room
PING = sse_event("ping", {"type": "ping"})
MESSAGE_STOP = sse_event("message_stop", {"type": "message_stop"})
# The first and the last events of every stream, from bytes; keys in the order the dicts had them.
_MESSAGE_START = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"%b","type":"message",'
                  b'"role":"assistant","model":%b,"content":[],"stop_reason":null,"stop_sequence":null,'
                  b'"usage":{"input_tokens":%d,"cache_creation_input_tokens":0,"cache_read_input_tokens":%d,'
                  b'"output_tokens":0}}}\n\n')
_MESSAGE_DELTA = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"%b","stop_sequence":%b},'
                  b'"usage":{"input_tokens":%d,"cache_creation_input_tokens":0,"cache_read_input_tokens":%d,'
                  b'"output_tokens":%d}}\n\n')
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
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


def anthropic_error(err: GatewayError) -> Reply:
    """Anthropic's error shape on every status, the 502 included (plain text is OpenAI-only)."""
    return Reply(err.status, orjson.dumps(_error_body(err, err.message)), JSON, dict(err.headers))


def _error_body(err: GatewayError, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status) or ("api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesTranslator(ChatBacked):
    endpoint = "messages"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.stream = False
        self.stops: list[str] = []
        self.prompt_estimate = 0
        self._context_window = 0
        self._id = ""
        self._blocks: Blocks | None = None
        self._matcher: StopMatcher | None = None
        self._stop_sequence: str | None = None
        self._usage = Usage()  # the latest the backend reported (for message_start)
        self._started = False
        self._note: str | None = None  # why the gateway ended the output early
        self._runs = TextRuns()

    # -- request ----------------------------------------------------------

    def prompt(self, body: Any) -> tuple[Model, Prompt]:
        """Validate and convert what decides the prompt (shared with count_tokens)."""
        model, self.name = lookup_model(self.ctx, body)
        self._context_window = model.context_window
        mapped = build_chat(body, model, self.ctx.seal)
        self.prompt_estimate = estimate_tokens(mapped.chat)
        return model, mapped

    def request(self, body: Any) -> UpstreamCall:
        model, mapped = self.prompt(body)
        chat = mapped.chat
        asked = body.get("max_tokens")
        if not positive_int(asked):
            raise errors.invalid("'max_tokens' is required: a positive integer.", param="max_tokens")
        self.stream = stream = stream_flag(body)
        forward, single = capabilities.parallel_tool_calls(
            model, False if chat.pop("parallel_tool_calls", None) is False else None)
        if forward is not None:
            chat["parallel_tool_calls"] = forward
        self._id = new_id("msg_")
        self._blocks = Blocks(mapped.thinking, self.ctx.seal, mapped.show_thinking, single_tool_call=single,
                              stream=stream)
        self.stops = chat.get("stop", [])
        self._matcher = StopMatcher(self.stops) if self.stops else None
        chat["max_tokens"] = cap = self._clamp(asked, model.max_output_tokens)
        chat["stream"] = stream
        if stream:
            # Continuous stats put the prompt size on the first chunk (for message_start) and keep
            # billing exact when a stop sequence or a leaving client ends the stream early.
            chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return UpstreamCall(model, "/chat/completions", chat, stream, cap)

    def _clamp(self, asked: int, model_max: int) -> int:
        """max_tokens that fits the context with the prompt, by estimate.

        Claude Code asks for 32k-128k; vLLM <= 0.16 and SGLang reject prompt +
        max_tokens > context (0.33 clamps by itself). An exact count costs a
        /tokenize round trip on every request for the rare case where the
        estimate is wrong; the estimate is high, and if the backend still
        refuses, the refusal reaches the client in the wording that makes
        Claude Code retry with a smaller max_tokens.
        """
        room = self._context_window - self.prompt_estimate
        return min(asked, model_max, max(room, MIN_OUTPUT))

    # -- JSON answer ----------------------------------------------------

    def _response(self, data: dict[str, Any]) -> Usage | None:
        choices = choices_of(data)
        if not choices:
            raise malformed()
        self._choice(choices[0], part_of(choices[0], "message"))
        return Usage.from_openai(data.get("usage"))

    def render(self, usage: Usage, cost_nano: int) -> bytes:
        """The Message object; token counts only, no cost field (seed)."""
        assert self._blocks is not None
        return orjson.dumps({
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self.name,
            "content": self._blocks.content(),
            "stop_reason": self._stop_reason(),
            "stop_sequence": self._stop_sequence,
            "usage": _usage(usage),
        })

    # -- stream -----------------------------------------------------------

    def _chunk(self, payload: bytes) -> Step:
        blocks = self._blocks
        if self._started and self._matcher is None and blocks is not None:
            one = self._runs.one(payload)  # a plain text delta read alone (a paced stream's every read)
            if one is not None:
                field, body, usage = one
                if usage is not None:
                    self._usage = usage
                blocks.text_run([(field, [body])])
                return blocks.take(), usage, 1, False
        data = backend_json(payload)
        usage = Usage.from_openai(data["usage"]) if "usage" in data else None
        if usage is not None:
            self._usage = usage
        head = self._message_start()
        choices = choices_of(data)
        if not choices:
            return head, usage, 0, False
        assert self._blocks is not None
        said = self._choice(choices[0], part_of(choices[0], "delta"))
        if said and self._matcher is None:
            self._runs.learn(payload, data)
        return head + self._blocks.take(), usage, 1 if said else 0, self._stop_sequence is not None

    def chunks(self, payloads: list[bytes], start: int, most: int) -> Run | None:
        """Mid-stream, a run of plain text deltas (protocols/text_runs.py) in one tight loop, each
        still its own content_block_delta event. Not with stop sequences: those need each piece
        looked at where it may end the output."""
        if not self._started or self._matcher is not None or self._blocks is None:
            return None
        groups, usage, taken = self._runs.take(payloads, start, most)
        if not taken:
            return None
        if usage is not None:
            self._usage = usage
        self._blocks.text_run(groups)
        return self._blocks.take(), usage, taken, taken

    def finish(self, usage: Usage, cost_nano: int) -> bytes:
        assert self._blocks is not None
        head = self._message_start()
        if self._matcher is not None:
            self._blocks.text(self._matcher.flush())  # the tail held back in case it began a stop sequence
        self._blocks.close()
        stop = self._stop_sequence
        if self._note:
            delta: dict[str, Any] = {"stop_reason": self._stop_reason(), "stop_sequence": stop}
            event = {"type": "message_delta", "delta": delta, "usage": _usage(usage), "kiln_note": self._note}
            end = sse_event("message_delta", event)
        else:
            end = _MESSAGE_DELTA % (self._stop_reason().encode(), b"null" if stop is None else orjson.dumps(stop),
                                    usage.prompt_tokens - usage.cached_tokens, usage.cached_tokens,
                                    usage.completion_tokens)
        return head + self._blocks.take() + end + MESSAGE_STOP

    def truncate(self, note: str) -> bytes:
        """The gateway ends the output (the money ran out): finish() reports max_tokens."""
        self._note = note
        return b""

    def keepalive(self) -> bytes:
        """`message_start` comes first in Anthropic's grammar: a slow first token gets it at once,
        then pings."""
        return self._message_start() or PING

    def _message_start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        u = self._usage
        # Nothing reported yet: the prompt estimate until message_delta.
        prompt = u.prompt_tokens - u.cached_tokens if u.exact else self.prompt_estimate
        return _MESSAGE_START % (self._id.encode(), orjson.dumps(self.name), prompt, u.cached_tokens)

    # -- shared by both forms ----------------------------------------------

    def _choice(self, choice: dict[str, Any], message: dict[str, Any]) -> bool:
        """Feed one choice's message (JSON) or delta (stream) into the blocks; True if it carried output."""
        blocks = self._blocks
        assert blocks is not None
        thought = text_of(message, "reasoning", "reasoning_content")
        blocks.reasoning(thought)
        text = said = text_of(message, "content")
        if text:
            if self._matcher is not None:
                if self.stream:
                    text, hit = self._matcher.feed(text), self._matcher.matched
                else:
                    text, hit = cut_at_stop(text, self.stops)
                if hit is not None:
                    self._stop_sequence, self._finish_reason = hit, "stop"
            blocks.text(text)
        calls = tool_calls_of(message)
        for position, entry in enumerate(calls):
            blocks.tool_call(entry if self.stream else {**entry, "index": position})  # JSON calls carry no index
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and self._stop_sequence is None:
            self._finish_reason = reason
            stopped = choice.get("stop_reason")
            if isinstance(stopped, str) and stopped in self.stops:
                self._stop_sequence = stopped
        return bool(thought or said or calls)

    def finish_reason(self) -> str | None:
        if self._note is not None:
            return "length"
        if self._blocks is not None and self._blocks.has_tool_use:
            return "tool_calls"
        return self._finish_reason

    def _stop_reason(self) -> str:
        assert self._blocks is not None
        if self._note is not None or self._finish_reason == "length":
            return "max_tokens"
        if self._blocks.has_tool_use:
            return "tool_use"
        if self._stop_sequence is not None:
            return "stop_sequence"
        return "refusal" if self._finish_reason == "content_filter" else "end_turn"

    # -- errors -------------------------------------------------------------

    def error(self, err: GatewayError) -> Reply:
        return Reply(err.status, orjson.dumps(self._error_body(err)), JSON, dict(err.headers))

    def stream_error(self, err: GatewayError) -> bytes:
        """After the 200: an `error` event and no message_stop, so no client takes it for a clean end."""
        return sse_event("error", self._error_body(err))

    def _error_body(self, err: GatewayError) -> dict[str, Any]:
        message = self._overflow(err.message) if err.code == "context_length_exceeded" else err.message
        return _error_body(err, message)

    def _overflow(self, message: str) -> str:
        """A backend's context-overflow message in the two wordings Claude Code acts on.

        "prompt is too long" makes it compact the conversation; "input length
        and `max_tokens` exceed context limit" makes it retry with a smaller
        max_tokens. Any other wording makes it retry the same request.
        """
        limit = _number(_LIMIT, message) or self._context_window
        prompt = overflow_tokens(message) or _number(_PROMPT, message)
        asked = _number(_ASKED, message)
        if asked is not None and prompt is not None and prompt < limit:
            return (f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > {limit}, "
                    "decrease input length or `max_tokens` and try again")
        return f"prompt is too long: {prompt or max(self.prompt_estimate, limit + 1)} tokens > {limit} maximum"


def _usage(u: Usage) -> dict[str, int]:
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": u.completion_tokens,
    }


def _number(pattern: re.Pattern[str], text: str) -> int | None:
    m = pattern.search(text)
    return int(next(g for g in m.groups() if g)) if m else None

"""OpenAI Chat Completions: validation in, nearly the identity out.

On the way in: the contract's checks (empty messages, tools without
descriptions), the capability rules (protocols/capabilities.py: forced tool
choice, structured output, image input, ignore_eos on gpt-oss), `stream`
coerced to a boolean, usage always requested upstream, and what backend
templates need (no empty `tools`, no orphan `tool_choice`, reasoning under
both of its names, a late system message turned into a user turn in place).
On the way out: stop strings and one-tool-call-per-reply enforced where the
model cannot be told; everything else passes through as bytes.
"""

from __future__ import annotations

from typing import Any

from kiln.catalog import Model
from kiln.core import errors
from kiln.protocols import capabilities
from kiln.protocols.base import Context, UpstreamCall, as_bool, positive_int
from kiln.protocols.chat_backed import lookup_model
from kiln.protocols.openai.passthrough import Passthrough
from kiln.protocols.stop import StopMatcher, cut_at_stop, parse_stop

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_SYSTEM = frozenset({"system", "developer"})


class ChatTranslator(Passthrough):
    endpoint = "chat.completions"
    chunk_object = "chat.completion.chunk"
    # vLLM's role chunk and its finish chunk carry no output
    empty_piece = (b'"delta":{}', b'"delta":{"role":"assistant","content":""}')

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.stops: list[str] = []
        self.single_tool_call = False
        self._matchers: dict[int, StopMatcher] = {}

    # -- request ----------------------------------------------------------

    def request(self, body: Any) -> UpstreamCall:
        model, self.name = lookup_model(self.ctx, body)
        body.pop("model")
        body["messages"] = _check_messages(body.get("messages"), model)
        stream = self._stream_options(body)
        _check_tools(body, model)
        forward, self.single_tool_call = capabilities.parallel_tool_calls(
            model, as_bool(body.pop("parallel_tool_calls", None)))
        if forward is not None:
            body["parallel_tool_calls"] = forward
        if as_bool(body.get("ignore_eos")) is True:
            capabilities.refuse_ignore_eos(model)
        _check_response_format(body.get("response_format"), model)
        self.stops = parse_stop(body.get("stop"))
        if self.stops and stream:
            # Cumulative usage on every chunk keeps billing exact when Kiln cuts the stream early.
            body["stream_options"]["continuous_usage_stats"] = True
        cap = model.max_output_tokens
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if value is not None:
                if not positive_int(value):
                    raise errors.invalid(f"'{name}' must be a positive integer.", param=name)
                cap = body[name] = min(value, model.max_output_tokens)
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not positive_int(n):
            raise errors.invalid("'n' must be a positive integer.", param="n")
        return UpstreamCall(model, "/chat/completions", body, stream, cap, outputs=n)

    # -- JSON answer ----------------------------------------------------------

    def _enforce_json(self, data: dict[str, Any]) -> None:
        for choice in data.get("choices") or ():
            message = choice.get("message") if isinstance(choice, dict) else None
            if not isinstance(message, dict):
                continue
            if self.stops and isinstance(message.get("content"), str):
                text, hit = cut_at_stop(message["content"], self.stops)
                if hit is not None:
                    message["content"] = text
                    choice["finish_reason"], choice["stop_reason"] = "stop", hit
            calls = message.get("tool_calls")
            if self.single_tool_call and isinstance(calls, list) and len(calls) > 1:
                message["tool_calls"] = calls[:1]

    # -- stream -----------------------------------------------------------

    def _parses(self) -> bool:
        return bool(self.stops) or self.single_tool_call

    def _enforce(self, data: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """Stop strings and a single tool call, enforced inside the chunk."""
        keep: list[dict[str, Any]] = []
        for choice in data["choices"]:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = choice["delta"] = {}
            if self.single_tool_call and isinstance(delta.get("tool_calls"), list):
                delta["tool_calls"] = [c for c in delta["tool_calls"] if isinstance(c, dict) and c.get("index", 0) == 0]
                if not delta["tool_calls"]:
                    del delta["tool_calls"]
            if self.stops and not self._stop(choice, delta):
                continue
            if delta or choice.get("finish_reason") is not None:
                keep.append(choice)
        ended = bool(self.stops) and bool(self._matchers) and all(
            m.matched is not None for m in self._matchers.values())
        return keep, ended

    def _stop(self, choice: dict[str, Any], delta: dict[str, Any]) -> bool:
        """Cut this choice's text at a stop string; False once the choice has stopped."""
        index = choice.get("index", 0)
        matcher = self._matchers.setdefault(index if isinstance(index, int) else 0, StopMatcher(self.stops))
        if matcher.matched is not None:
            return False
        if isinstance(delta.get("content"), str) and delta["content"]:
            delta["content"] = matcher.feed(delta["content"])
        if matcher.matched is not None:
            choice["finish_reason"], choice["stop_reason"] = "stop", matcher.matched
        elif choice.get("finish_reason") is not None:
            delta["content"] = delta.get("content", "") + matcher.flush()
        return True

    def truncate(self, note: str) -> bytes:
        return self._truncated([{"index": 0, "delta": {}, "finish_reason": "length"}], note)


def _check_messages(messages: Any, model: Model) -> list[dict[str, Any]]:
    """Validate the conversation; returns it with late system messages turned into user turns."""
    if not isinstance(messages, list) or not messages:
        raise errors.invalid(
            "Invalid 'messages': the array must contain at least one message.", param="messages", code="empty_array"
        )
    out = []
    leading = True  # still in the system messages that open the conversation
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise errors.invalid(f"'{where}' must be an object with a role.", param=where)
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise errors.invalid(
                f"'{where}.role' must be one of system, developer, user, assistant, tool; got {role!r}.",
                param=f"{where}.role",
            )
        _check_content(msg, role, where, model)
        if role == "assistant":
            # Interleaved thinking: templates read one name or the other.
            thought = msg.get("reasoning") or msg.get("reasoning_content")
            if isinstance(thought, str) and thought:
                msg["reasoning"] = msg["reasoning_content"] = thought
        if role in _SYSTEM and not leading:
            msg = _late_system_message(msg.get("content"))
        leading = leading and role in _SYSTEM
        out.append(msg)
    return out


def _late_system_message(content: Any) -> dict[str, Any]:
    """A system or developer message after the conversation started, as a user turn marked as
    system context, in place: several chat templates (Qwen3.5/3.6, ...) reject a system message
    anywhere but first, and merging it into the first would move it out of order."""
    marker = "[System context]"
    if isinstance(content, list):
        return {"role": "user", "content": [{"type": "text", "text": marker}, *content]}
    return {"role": "user", "content": f"{marker}\n{content if isinstance(content, str) else ''}"}


def _check_content(msg: dict[str, Any], role: str, where: str, model: Model) -> None:
    content = msg.get("content")
    if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
        raise errors.invalid(f"'{where}.tool_call_id' is required on tool messages.", param=f"{where}.tool_call_id")
    if content is None:
        if role == "assistant":  # a reply that was only tool calls
            return
        raise errors.invalid(f"'{where}.content' is required.", param=f"{where}.content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise errors.invalid(f"'{where}.content' must be a string or an array of parts.", param=f"{where}.content")
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise errors.invalid(f"'{where}.content' parts must be objects with a type.", param=f"{where}.content")
        if part["type"] == "image_url":
            capabilities.require_image_input(model, f"{where}.content")


def _check_tools(body: dict[str, Any], model: Model) -> None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise errors.invalid("'tools' must be an array.", param="tools")
    if not tools:
        body.pop("tools", None)
        body.pop("tool_choice", None)
        return
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise errors.invalid(f"'tools[{i}]' must be a function tool: {{\"type\": \"function\", \"function\": {{...}}}}.",
                                 param=f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise errors.invalid(f"'tools[{i}].function.name' is required.", param=f"tools[{i}].function.name")
        if not isinstance(fn.get("description"), str) or not fn["description"].strip():
            raise errors.invalid(
                f"'tools[{i}].function.description' is required: say what the function does.",
                param=f"tools[{i}].function.description",
            )
        names.add(fn["name"])
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return
    if choice == "required":
        capabilities.require_tool_choice(model, "required", 'tool_choice "required"')
    elif isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or name not in names:
            raise errors.invalid(f"'tool_choice' names {name!r}, which is not in 'tools'.", param="tool_choice")
        capabilities.require_tool_choice(model, "named", "a named tool_choice")
    else:
        raise errors.invalid(
            "'tool_choice' must be \"auto\", \"none\", \"required\" or "
            "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
            param="tool_choice",
        )


def _check_response_format(fmt: Any, model: Model) -> None:
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise errors.invalid("'response_format.type' must be text, json_object or json_schema.",
                             param="response_format")
    if kind != "text":
        capabilities.require_structured_output(model, f"response_format {kind}", "response_format")

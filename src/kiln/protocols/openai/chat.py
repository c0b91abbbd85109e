"""OpenAI Chat Completions: validation in, nearly the identity out.

What it adds on the way in: the contract's checks (empty messages, tools
without descriptions, forced tool choice only where the model applies it,
response_format only where supported, ignore_eos on gpt-oss), `stream`
coerced to a boolean, usage always requested upstream, and the
normalisations vLLM needs (no empty `tools`, no orphan `tool_choice`).
On the way out: `usage.cost`, the public model name, stop strings and
`parallel_tool_calls: false` enforced, and the usage chunk removed unless
the client asked for it. Streamed chunks pass through as bytes unless one of
those enforcements needs to look inside them.
"""

from __future__ import annotations

from typing import Any

from kiln.catalog import Catalog, Model
from kiln.core import errors
from kiln.protocols.base import as_bool
from kiln.protocols.openai.passthrough import OpenAITranslator
from kiln.protocols.stop import StopMatcher, cut_at_stop

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_STRINGS = 16


def lookup_model(catalog: Catalog, body: dict[str, Any]) -> Model:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise errors.invalid("'model' is required: a model ID from GET /v1/models.", param="model")
    model = catalog.get(name)
    if model is None:
        raise errors.not_found(
            f"The model '{name}' does not exist or is not served here. GET /v1/models lists the IDs.",
            code="model_not_found",
            param="model",
        )
    return model


def parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise errors.invalid("'stop' must be a string or an array of strings.", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.invalid(f"'stop' takes at most {MAX_STOP_STRINGS} strings.", param="stop")
    return [s for s in stops if s]


class ChatTranslator(OpenAITranslator):
    endpoint = "chat.completions"
    upstream_path = "/chat/completions"
    chunk_object = "chat.completion.chunk"

    def __init__(self, catalog: Catalog) -> None:
        super().__init__(catalog)
        self.stops: list[str] = []
        self.single_tool_call = False
        self._matchers: dict[int, StopMatcher] = {}

    # -- request ----------------------------------------------------------

    def request(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise errors.invalid("The request body must be a JSON object.")
        self.model = model = lookup_model(self.catalog, body)
        _check_messages(body.get("messages"), model)
        stream = self._stream_options(body)
        _normalise_tools(body, model)
        if "parallel_tool_calls" in body and not model.capabilities.parallel_tool_calls:
            # The model cannot be told; Kiln keeps only the first call itself.
            self.single_tool_call = as_bool(body.pop("parallel_tool_calls")) is False

        if model.family == "gpt-oss" and as_bool(body.get("ignore_eos")) is True:
            raise errors.invalid(
                f"'ignore_eos' is not supported on {model.id} (gpt-oss models).",
                param="ignore_eos",
                code="unsupported_parameter",
            )
        fmt = body.get("response_format")
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind not in ("text", "json_object", "json_schema"):
                raise errors.invalid(
                    "'response_format.type' must be text, json_object or json_schema.", param="response_format"
                )
            if kind != "text" and not model.capabilities.response_format:
                raise errors.invalid(
                    f"Model '{model.id}' does not support structured output (response_format {kind}). "
                    "Ask for JSON in the prompt and validate it in your client.",
                    param="response_format",
                    code="unsupported_parameter",
                )
        self.stops = parse_stop(body.get("stop"))
        if self.stops and stream:
            # Cumulative usage on every chunk keeps billing exact when Kiln cuts the stream early.
            body["stream_options"]["continuous_usage_stats"] = True
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise errors.invalid(f"'{name}' must be a positive integer.", param=name)
                body[name] = min(value, model.max_output_tokens)
        self._body = body
        return body

    # -- JSON response ----------------------------------------------------

    def response(self, raw: bytes) -> None:
        data = self._load_response(raw)
        for choice in data.get("choices") or ():
            message = choice.get("message") or {}
            if self.stops and isinstance(message.get("content"), str):
                text, hit = cut_at_stop(message["content"], self.stops)
                if hit is not None:
                    message["content"] = text
                    choice["finish_reason"] = "stop"
                    choice["stop_reason"] = hit
            calls = message.get("tool_calls")
            if self.single_tool_call and isinstance(calls, list) and len(calls) > 1:
                message["tool_calls"] = calls[:1]

    # -- stream -----------------------------------------------------------

    def _parse_chunks(self) -> bool:
        return bool(self.stops) or self.single_tool_call

    def _chunk_parsed(self, data: dict[str, Any]) -> bytes:
        """Stop strings and a single tool call, enforced inside the chunk."""
        keep: list[dict[str, Any]] = []
        for choice in data.get("choices") or ():
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                delta = choice["delta"] = {}
            if self.single_tool_call and isinstance(delta.get("tool_calls"), list):
                delta["tool_calls"] = [c for c in delta["tool_calls"] if c.get("index", 0) == 0]
                if not delta["tool_calls"]:
                    del delta["tool_calls"]
            if self.stops:
                matcher = self._matchers.setdefault(choice.get("index", 0), StopMatcher(self.stops))
                if matcher.matched is not None:
                    continue
                if isinstance(delta.get("content"), str) and delta["content"]:
                    delta["content"] = matcher.feed(delta["content"])
                if matcher.matched is not None:
                    choice["finish_reason"] = "stop"
                    choice["stop_reason"] = matcher.matched
                elif choice.get("finish_reason") is not None:
                    delta["content"] = delta.get("content", "") + matcher.flush()
            if delta or choice.get("finish_reason") is not None:
                keep.append(choice)
        if self.stops and self._matchers and all(m.matched is not None for m in self._matchers.values()):
            self.done = True
        return self._emit(data, keep)

    def truncate(self, note: str) -> bytes:
        return self._truncated([{"index": 0, "delta": {}, "finish_reason": "length"}], note)


def _check_messages(messages: Any, model: Model) -> None:
    if not isinstance(messages, list) or not messages:
        raise errors.invalid(
            "Invalid 'messages': the array must contain at least one message.", param="messages", code="empty_array"
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise errors.invalid(f"'messages[{i}]' must be an object with a role.", param=f"messages[{i}]")
        role = msg.get("role")
        if role not in ROLES:
            raise errors.invalid(
                f"'messages[{i}].role' must be one of system, developer, user, assistant, tool; got {role!r}.",
                param=f"messages[{i}].role",
            )
        if role == "assistant":
            # Interleaved thinking: templates read one name or the other.
            thought = msg.get("reasoning") or msg.get("reasoning_content")
            if thought:
                msg["reasoning"] = msg["reasoning_content"] = thought
        content = msg.get("content")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise errors.invalid(f"'messages[{i}].tool_call_id' is required on tool messages.",
                                 param=f"messages[{i}].tool_call_id")
        if content is None:
            if role == "assistant":  # a reply that was only tool calls
                continue
            raise errors.invalid(f"'messages[{i}].content' is required.", param=f"messages[{i}].content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise errors.invalid(f"'messages[{i}].content' parts must be objects with a type.",
                                         param=f"messages[{i}].content")
                if part["type"] == "image_url" and not model.capabilities.image_input:
                    raise errors.invalid(
                        f"Model '{model.id}' does not accept image input; send text only.",
                        param=f"messages[{i}].content",
                        code="unsupported_content",
                    )
        elif not isinstance(content, str):
            raise errors.invalid(f"'messages[{i}].content' must be a string or an array of parts.",
                                 param=f"messages[{i}].content")


def _normalise_tools(body: dict[str, Any], model: Model) -> None:
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
    if choice is None:
        return
    allowed = model.capabilities.tool_choice
    if choice in ("auto", "none"):
        mode = choice
    elif choice == "required":
        mode = "required"
    elif isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise errors.invalid(f"'tool_choice' names {name!r}, which is not in 'tools'.", param="tool_choice")
        mode = "named"
    else:
        raise errors.invalid(
            "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
            param="tool_choice",
        )
    if mode not in allowed:
        what = "tool_choice \"required\"" if mode == "required" else "a named tool_choice"
        raise errors.invalid(
            f"Model '{model.id}' does not apply forced tool choice ({what}); send tool_choice \"auto\".",
            param="tool_choice",
            code="unsupported_parameter",
        )

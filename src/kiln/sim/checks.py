"""Request validation that reproduces vLLM's 400s (the gateway passes them through).

Each check returns ``None`` or an :class:`Invalid` carrying vLLM's wording. Schema
errors mimic FastAPI/pydantic (type ``"Bad Request"``); semantic checks use
vLLM's ``BadRequestError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Invalid:
    """A rejected request: status, message, error type, param."""

    message: str
    etype: str = "BadRequestError"
    param: str | None = None
    status: int = 400


def schema_error(kind: str, loc: str, msg: str, value: Any = None) -> Invalid:
    """A pydantic-style validation error, as FastAPI's RequestValidationError prints it."""
    detail = {"type": kind, "loc": ("body", loc), "msg": msg, "input": value}
    return Invalid(f"[{detail!r}]", "Bad Request", None)


def invalid_json(reason: str) -> Invalid:
    """What FastAPI says for a body that is not valid JSON."""
    detail = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error", "input": {}, "ctx": {"error": reason}}
    return Invalid(f"[{detail!r}]", "Bad Request", None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_common(body: dict[str, Any]) -> Invalid | None:
    """Checks shared by chat and completions: model, stream, stream_options, max_tokens."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return schema_error("string_type", "model", "Input should be a valid string", model)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return schema_error("bool_type", "stream", "Input should be a valid boolean", stream)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            return schema_error("model_type", "stream_options", "Input should be a valid dictionary or object", options)
        if stream is not True:
            return Invalid("Stream options can only be defined when `stream=True`.")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and not _is_int(value):
            return schema_error("int_type", key, "Input should be a valid integer", value)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            return schema_error("list_type", "stop", "Input should be a valid list of strings", stop)
    return None


def check_chat(body: dict[str, Any]) -> Invalid | None:
    """vLLM's ChatCompletionRequest validation, in the same order and wording."""
    if "messages" not in body:
        return schema_error("missing", "messages", "Field required")
    messages = body["messages"]
    if not isinstance(messages, list):
        return schema_error("list_type", "messages", "Input should be a valid list", messages)
    if not messages:
        return schema_error("too_short", "messages", "List should have at least 1 item after validation, not 0", [])
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            return schema_error("missing", f"messages.{i}.role", "Field required", msg)
    bad = check_common(body)
    if bad is not None:
        return bad
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and value < 1:
            return Invalid(f"max_tokens must be at least 1, got {value}.", param=key)
    return check_tools(body)


def check_tools(body: dict[str, Any]) -> Invalid | None:
    """vLLM's check_tool_usage validator (plus: an empty tools array is rejected)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return schema_error("list_type", "tools", "Input should be a valid list", tools)
        if not tools:
            return Invalid("`tools` must not be an empty array; omit `tools` when no tools are offered.", param="tools")
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                return schema_error("missing", "tools.function.name", "Field required", tool)
    if "tool_choice" not in body or body["tool_choice"] is None or body["tool_choice"] == "none":
        return None
    choice = body["tool_choice"]
    if tools is None:
        return Invalid("When using `tool_choice`, `tools` must be set.")
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        return Invalid(
            f"Invalid value for `tool_choice`: {choice}! "
            'Only named tools, "none", "auto" or "required" are supported.'
        )
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        fn = choice.get("function")
        if not isinstance(fn, dict):
            return Invalid(f"Invalid value for `function`: `{fn}` in `tool_choice`! {usage}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            return Invalid(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}")
        if not any(t["function"]["name"] == name for t in tools):
            return Invalid("The tool specified in `tool_choice` does not match any of the specified `tools`")
    return None


def check_completion(body: dict[str, Any]) -> Invalid | None:
    """CompletionRequest validation: prompt shape plus the common checks."""
    if "prompt" not in body or body["prompt"] is None:
        return schema_error("missing", "prompt", "Field required")
    bad = check_common(body)
    if bad is not None:
        return bad
    value = body.get("max_tokens")
    if value is not None and value < 0:
        return Invalid(f"max_tokens must be at least 0, got {value}.", param="max_tokens")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs < 0):
        return schema_error("int_type", "logprobs", "Input should be a valid integer", logprobs)
    return None


def prompts_of(prompt: Any) -> list[str | list[int]] | None:
    """Normalise a completions prompt into a list of (text | token ids); None if malformed."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(_is_int(t) for t in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return list(prompt)
    return None


def context_error(n_prompt: int, max_len: int) -> Invalid:
    """vLLM 0.33: the prompt alone does not fit."""
    return Invalid(
        f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
        f"{n_prompt} input tokens, which exceeds this limit even without any output tokens. "
        f"Please reduce the length of the input prompt. (parameter=input_tokens, value={n_prompt})",
        param="input_tokens",
    )


def legacy_length_error(n_prompt: int, max_tokens: int, max_len: int) -> Invalid:
    """vLLM 0.16: prompt + max_tokens must fit."""
    return Invalid(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
        f"context length is {max_len} tokens and your request has {n_prompt} input tokens "
        f"({max_tokens} > {max_len} - {n_prompt}).",
        param="max_tokens",
    )


def fit_max_tokens(
    n_prompt: int, requested: int | None, default: int | None, max_len: int, legacy: bool
) -> int | Invalid:
    """Effective max_tokens after the context-window rules (clamp or legacy 400)."""
    if n_prompt >= max_len:
        return context_error(n_prompt, max_len)
    room = max_len - n_prompt
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        return legacy_length_error(n_prompt, requested, max_len) if legacy else room
    return requested

"""Responses request -> chat-completions request (protocols.md 5.3).

The Responses API is stateless here: the whole conversation arrives in
`input` every time, as typed items. They become chat messages: leading
system/developer messages merge into one system message (templates accept
only one, at the start; later ones become user messages), consecutive tool
calls become one assistant message, and a reasoning item rides on the next
assistant message as `reasoning` + `reasoning_content` (the names vLLM and
the Qwen/GLM templates read). Custom (freeform) tools are offered to the
backend as functions with one string parameter, `input`. Tools only OpenAI
can run (web search, tool search, namespaces, ...) are dropped rather than
failing the request: Codex always sends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from kiln.catalog import Model
from kiln.core import errors
from kiln.protocols import capabilities
from kiln.protocols.base import as_bool
from kiln.protocols.reasoning import ReasoningSeal

ENCRYPTED = "reasoning.encrypted_content"
STATELESS = (
    "Kiln's Responses API is stateless: it stores no responses. Send store: false (or omit it) "
    "and pass the whole conversation in 'input' on every request."
)
# Fields that shape the response or only mean something to OpenAI: never forwarded.
_CONSUMED = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "reasoning", "include",
    "store", "stream", "stream_options", "max_output_tokens", "max_tool_calls", "text", "metadata",
    "client_metadata", "prompt_cache_key", "prompt_cache_retention", "service_tier", "user", "safety_identifier",
    "truncation", "top_logprobs", "previous_response_id", "conversation", "background", "prompt",
    "context_management",
})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
_SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass
class MappedRequest:
    """The chat body for the backend, plus what shaping the answer needs."""

    body: dict[str, Any]
    custom_tools: frozenset[str] = frozenset()
    encrypted_reasoning: bool = False
    summary: bool = False
    single_tool_call: bool = False
    max_output_tokens: int | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # backend name -> (namespace, name)


def map_request(body: dict[str, Any], model: Model, seal: ReasoningSeal | None) -> MappedRequest:
    """Validate a Responses body and build the chat-completions body for `model`."""
    _check_stateless(body)
    include = body.get("include") or []
    if not isinstance(include, list):
        raise errors.invalid("'include' must be an array of strings.", param="include")
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise errors.invalid("'reasoning' must be an object.", param="reasoning")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise errors.invalid("'instructions' must be a string.", param="instructions")

    tools, custom, namespaced = _map_tools(body.get("tools"))
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _CONSUMED}
    chat["messages"] = _messages(body.get("input"), instructions, model, seal, namespaced)
    if tools:
        chat["tools"] = tools
        choice = _map_tool_choice(body.get("tool_choice"), tools, model)
        if choice is not None:
            chat["tool_choice"] = choice
    out = MappedRequest(
        chat,
        custom_tools=custom,
        encrypted_reasoning=ENCRYPTED in include and seal is not None,
        summary=reasoning.get("summary") in ("auto", "concise", "detailed"),
        namespaced=namespaced,
    )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and tools:
        forward, out.single_tool_call = capabilities.parallel_tool_calls(model, as_bool(parallel) is not False)
        if forward is not None:
            chat["parallel_tool_calls"] = forward
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise errors.invalid("'max_output_tokens' must be a positive integer.", param="max_output_tokens")
        out.max_output_tokens = limit
        chat["max_tokens"] = min(limit, model.max_output_tokens)
    _map_effort(reasoning.get("effort"), model, chat)
    _map_text_format(body.get("text"), model, chat)
    out.echo = _echo(body, out.max_output_tokens, instructions, reasoning, parallel)
    return out


def _messages(raw_input: Any, instructions: str | None, model: Model, seal: ReasoningSeal | None,
              namespaced: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    """The chat messages of `input` (a string or items) after the instructions; at least one
    that is not a system message."""
    history = _History(model, seal, {v: k for k, v in namespaced.items()})
    if instructions:
        history.system.append(instructions)
    if isinstance(raw_input, str):
        history.add_message(0, {"role": "user", "content": raw_input})
    elif isinstance(raw_input, list):
        for i, item in enumerate(raw_input):
            history.add(i, item)
    messages = history.finish()
    if not any(m["role"] != "system" for m in messages):
        raise errors.invalid(
            "Invalid 'input': send a string or an array with at least one message.", param="input", code="empty_array"
        )
    return messages


def _echo(body: dict[str, Any], max_output_tokens: int | None, instructions: str | None,
          reasoning: dict[str, Any], parallel: Any) -> dict[str, Any]:
    """The request fields the response object repeats, with OpenAI's defaults where absent."""
    return {
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "parallel_tool_calls": as_bool(parallel) is not False,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "temperature": body.get("temperature"),
        "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
    }


def _check_stateless(body: dict[str, Any]) -> None:
    for name in ("previous_response_id", "conversation", "prompt"):
        if body.get(name) is not None:
            raise errors.invalid(f"'{name}' refers to server-side state. {STATELESS}", param=name,
                                 code="unsupported_parameter")
    if as_bool(body.get("store")) is True:
        raise errors.invalid(f"'store': true is not supported. {STATELESS}", param="store",
                             code="unsupported_parameter")
    if as_bool(body.get("background")) is True:
        raise errors.invalid(f"'background': true needs stored responses. {STATELESS}", param="background",
                             code="unsupported_parameter")


class _History:
    """Input items in, chat messages out, in one pass."""

    def __init__(self, model: Model, seal: ReasoningSeal | None, flat_names: dict[tuple[str, str], str]) -> None:
        self.model = model
        self.seal = seal
        self.flat_names = flat_names  # (namespace, name) -> the name the backend knows
        self.system: list[str] = []  # the one leading system message, merged
        self.messages: list[dict[str, Any]] = []
        self.reasoning: list[str] = []  # waiting for the next assistant message
        self.tool_images: list[dict[str, Any]] = []  # images from tool outputs, sent after the tool messages

    def add(self, i: int, item: Any) -> None:
        if not isinstance(item, dict):
            raise errors.invalid(f"'input[{i}]' must be an object.", param=f"input[{i}]")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ("function_call_output", "custom_tool_call_output"):
            self._flush_images()
        if kind == "message":
            self.add_message(i, item)
        elif kind == "reasoning":
            self._add_reasoning(item)
        elif kind in ("function_call", "custom_tool_call"):
            self._add_call(i, item, kind)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            self._add_output(i, item)
        elif kind == "item_reference":
            raise errors.invalid(f"'input[{i}]' is an item_reference. {STATELESS}", param=f"input[{i}]",
                                 code="unsupported_parameter")
        elif not isinstance(kind, str):
            raise errors.invalid(f"'input[{i}].type' is required.", param=f"input[{i}].type")
        # Other item types (web_search_call, compaction, ...) hold nothing a chat backend can use.

    def add_message(self, i: int, item: dict[str, Any]) -> None:
        role = item.get("role")
        where = f"input[{i}]"
        if not isinstance(role, str):
            raise errors.invalid(f"'{where}.role' must be one of user, assistant, system, developer; got {role!r}.",
                                 param=f"{where}.role")
        if role in _SYSTEM_ROLES:
            text = _text_of(item.get("content"), where, "\n")
            if not self.messages and not self.reasoning:
                self.system.append(text)
            else:  # a late system message: templates only take one, at the start
                self.messages.append({"role": "user", "content": text})
        elif role == "user":
            self.messages.append({"role": "user", "content": self._user_content(item.get("content"), where)})
        elif role == "assistant":
            self._assistant(new=True)["content"] = _text_of(item.get("content"), where, "")
        else:
            raise errors.invalid(f"'{where}.role' must be one of user, assistant, system, developer; got {role!r}.",
                                 param=f"{where}.role")

    def finish(self) -> list[dict[str, Any]]:
        self._flush_images()
        head = [{"role": "system", "content": "\n\n".join(self.system)}] if self.system else []
        return head + self.messages

    def _add_reasoning(self, item: dict[str, Any]) -> None:
        text = self.seal.open(item.get("encrypted_content")) if self.seal is not None else None
        if text is None:
            for key in ("content", "summary"):
                parts = item.get(key)
                if isinstance(parts, list):
                    text = "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
                    if text:
                        break
        if text:
            self.reasoning.append(text)

    def _add_call(self, i: int, item: dict[str, Any], kind: str) -> None:
        call_id, name = item.get("call_id"), item.get("name")
        if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
            raise errors.invalid(f"'input[{i}]' needs a string call_id and name.", param=f"input[{i}]")
        if kind == "custom_tool_call":
            value = item.get("input")
            arguments = orjson.dumps({"input": value if isinstance(value, str) else ""}).decode()
        else:
            raw = item.get("arguments")
            arguments = raw if isinstance(raw, str) else orjson.dumps(raw if raw is not None else {}).decode()
            namespace = item.get("namespace")
            if isinstance(namespace, str):
                name = self.flat_names.get((namespace, name), flat_name(namespace, name))
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        self._assistant(new=False).setdefault("tool_calls", []).append(call)

    def _add_output(self, i: int, item: dict[str, Any]) -> None:
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            raise errors.invalid(f"'input[{i}].call_id' is required.", param=f"input[{i}].call_id")
        output = item.get("output")
        where = f"input[{i}].output"
        if isinstance(output, list):
            texts = []
            for part in output:
                if isinstance(part, dict) and part.get("type") == "input_image":
                    self.tool_images.append(self._image(part, where))
                elif isinstance(part, dict) and isinstance(part.get("text"), str):
                    texts.append(part["text"])
            output = "\n".join(texts)
        elif not isinstance(output, str):
            output = "" if output is None else orjson.dumps(output).decode()
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": output})

    def _assistant(self, new: bool) -> dict[str, Any]:
        """The assistant message the next output lands in; it takes any pending reasoning."""
        last = self.messages[-1] if self.messages else None
        if new or last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": None}
            self.messages.append(last)
        if self.reasoning:
            text = "\n".join(filter(None, [last.get("reasoning"), *self.reasoning]))
            last["reasoning"] = last["reasoning_content"] = text
            self.reasoning = []
        return last

    def _user_content(self, content: Any, where: str) -> str | list[dict[str, Any]]:
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                    for p in content):
            return _text_of(content, where, "\n")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "input_image":
                parts.append(self._image(part, f"{where}.content[{j}]"))
            else:
                parts.append({"type": "text", "text": _text_of([part], where, "")})
        return parts

    def _image(self, part: dict[str, Any], where: str) -> dict[str, Any]:
        capabilities.require_image_input(self.model, where)
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise errors.invalid("input_image needs 'image_url' (a URL or a data: URI); file_id is not supported.",
                                 param=where, code="unsupported_content")
        image: dict[str, Any] = {"url": url}
        if part.get("detail") in ("low", "high", "auto"):
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}

    def _flush_images(self) -> None:
        if self.tool_images:
            self.messages.append({"role": "user", "content": self.tool_images})
            self.tool_images = []


def _text_of(content: Any, where: str, joiner: str) -> str:
    """The text of a message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise errors.invalid(f"'{where}.content' must be a string or an array of parts.", param=f"{where}.content")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise errors.invalid(
                f"'{where}.content' parts must be input_text or output_text here (input_image only in user "
                f"messages; input_file is not supported); got {kind!r}.",
                param=f"{where}.content", code="unsupported_content" if kind == "input_file" else None,
            )
    return joiner.join(texts)


def flat_name(namespace: str, name: str) -> str:
    """A namespace's function as one name a chat backend takes (letters, digits, _ and -)."""
    return f"{namespace}__{name}"


def _map_tools(tools: Any) -> tuple[list[dict[str, Any]], frozenset[str], dict[str, tuple[str, str]]]:
    """Function, custom and namespace tools as chat function tools (a namespace's functions
    flattened, with the namespace in the name); tools only OpenAI can run are dropped."""
    if tools is None:
        return [], frozenset(), {}
    if not isinstance(tools, list):
        raise errors.invalid("'tools' must be an array.", param="tools")
    out: list[dict[str, Any]] = []
    custom: set[str] = set()
    namespaced: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise errors.invalid(f"'tools[{i}]' must be an object with a type.", param=f"tools[{i}]")
        kind = tool.get("type")
        if kind == "namespace":
            out += _namespace_tools(tool, f"tools[{i}]", namespaced)
        elif kind in ("function", "custom"):
            fn = _function(tool, f"tools[{i}]", custom)
            out.append({"type": "function", "function": fn})
    return out, frozenset(custom), namespaced


def _namespace_tools(tool: dict[str, Any], where: str, namespaced: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    namespace, inner = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace or not isinstance(inner, list):
        raise errors.invalid(f"'{where}' (a namespace) needs a name and a list of tools.", param=where)
    out = []
    for j, member in enumerate(inner):
        if not isinstance(member, dict) or member.get("type") != "function":
            continue  # only functions can be offered to a chat backend
        fn = _function(member, f"{where}.tools[{j}]", set())
        flat = flat_name(namespace, fn["name"])
        namespaced[flat] = (namespace, fn["name"])
        out.append({"type": "function", "function": {**fn, "name": flat}})
    return out


def _function(tool: dict[str, Any], where: str, custom: set[str]) -> dict[str, Any]:
    """One function or custom (freeform) tool as a chat function."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise errors.invalid(f"'{where}.name' is required.", param=f"{where}.name")
    description = tool.get("description")
    if tool.get("type") == "function":
        if not isinstance(description, str) or not description.strip():
            raise errors.invalid(f"'{where}.description' is required: say what the function does.",
                                 param=f"{where}.description")
        parameters = tool.get("parameters")
        return {"name": name, "description": description,
                "parameters": parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}}
    custom.add(name)
    return {"name": name, "description": description if isinstance(description, str) and description
            else f"The freeform tool {name}.",
            "parameters": {"type": "object", "properties": {"input": {"type": "string",
                           "description": _custom_input_hint(tool.get("format"))}}, "required": ["input"]}}


def _custom_input_hint(fmt: Any) -> str:
    """What the single string parameter of a freeform tool must contain."""
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        return f"The raw input, which must match this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    return "The raw input text for the tool."


def _map_tool_choice(choice: Any, tools: list[dict[str, Any]], model: Model) -> Any:
    """Responses tool_choice -> chat tool_choice, refused where the model cannot apply it."""
    if choice is None or choice in ("auto", "none"):
        return choice
    names = {t["function"]["name"] for t in tools}
    if choice == "required":
        mode, mapped = "required", "required"
    elif isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise errors.invalid(f"'tool_choice' names {name!r}, which is not in 'tools'.", param="tool_choice")
        mode, mapped = "named", {"type": "function", "function": {"name": name}}
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return "required" if choice.get("mode") == "required" and "required" in model.capabilities.tool_choice \
            else "auto"
    elif isinstance(choice, dict):
        return None  # a built-in tool (web_search, ...) that was dropped with it
    else:
        raise errors.invalid('\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "name": ...}.',
                             param="tool_choice")
    capabilities.require_tool_choice(model, mode, 'tool_choice "required"' if mode == "required"
                                     else "a named tool_choice")
    return mapped


def _map_effort(effort: Any, model: Model, chat: dict[str, Any]) -> None:
    """reasoning.effort in the form the model family understands."""
    if not isinstance(effort, str):
        return
    if model.family == "gpt-oss":  # harmony: low/medium/high only, and it cannot be switched off
        chat["reasoning_effort"] = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}.get(effort, effort)
    elif model.family == "qwen3" and effort in ("none", "minimal"):
        kwargs = chat.get("chat_template_kwargs")
        chat["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": False}


def _map_text_format(text: Any, model: Model, chat: dict[str, Any]) -> None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return
    kind = fmt.get("type")
    if kind not in ("json_object", "json_schema"):
        raise errors.invalid("'text.format.type' must be text, json_object or json_schema.", param="text.format")
    capabilities.require_structured_output(model, f"text.format {kind}", "text.format")
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    else:
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}

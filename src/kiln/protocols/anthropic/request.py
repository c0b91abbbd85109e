"""Anthropic Messages request -> chat-completions request.

Shared by POST /v1/messages and /v1/messages/count_tokens, so a count is
taken on exactly the prompt a generation would see. What the mapping has to
get right for real templates and real clients (protocols.md §4, §5.1):

- one leading system message: Claude Code's per-request billing-header block
  is dropped (its nonce would defeat prefix caching), system messages before
  the first assistant turn are merged into it, later ones become user text
  (several templates reject a late system message);
- tool results become `tool` messages right after the assistant turn that
  called them, before any user text; consecutive same-role turns are merged;
- thinking travels as `reasoning`/`reasoning_content` (never as content);
  images and PDFs a model cannot take become a short placeholder the model
  can mention, so a conversation that once carried one does not fail forever;
- server tools the backend cannot run, and deferred tools nobody loaded, are
  dropped, with any tool_choice that points at them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from kiln.catalog import Model
from kiln.core import errors
from kiln.protocols import capabilities
from kiln.protocols.reasoning import ReasoningSeal

log = logging.getLogger("kiln.messages")

BILLING_PREFIX = "x-anthropic-billing-header:"
IMAGE_TOKENS = 1600  # what one image costs in the prompt estimate (a large image on common VLMs)
BYTES_PER_TOKEN = 3  # on the high side for English and JSON on real tokenizers (about 3.5-4)
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
_MEDIA = ("image/jpeg", "image/png", "image/gif", "image/webp")

Part = dict[str, Any]


@dataclass(slots=True)
class Prompt:
    """A Messages request mapped to chat completions, up to the prompt (no max_tokens, no stream)."""

    chat: dict[str, Any]
    thinking: bool  # the client asked for thinking blocks
    show_thinking: bool  # ... with their text (`display: "omitted"` sends them empty, signature only)


def build_chat(body: dict[str, Any], model: Model, seal: ReasoningSeal) -> Prompt:
    """The chat-completions body for `body` and how thinking was asked for."""
    referenced = _tool_references(body.get("messages"))
    messages = _messages(body.get("messages"), body.get("system"), model, seal)
    chat: dict[str, Any] = {"messages": messages}
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False  # prefill
    tools = _tools(body.get("tools"), referenced)
    if tools:
        chat["tools"] = tools
        _tool_choice(chat, body.get("tool_choice"), {t["function"]["name"] for t in tools}, model)
    for name in ("temperature", "top_p", "top_k"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise errors.invalid(f"'{name}' must be a number.", param=name)
            chat[name] = value
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise errors.invalid("'stop_sequences' must be an array of strings.", param="stop_sequences")
        if any(stops):
            chat["stop"] = [s for s in stops if s]
    _output_format(chat, body.get("output_config"), model)
    thinking = _reasoning(chat, body, model)
    raw = body.get("thinking")
    display = raw.get("display") if isinstance(raw, dict) else None
    return Prompt(chat, thinking, show_thinking=display != "omitted")


def estimate_tokens(chat: dict[str, Any]) -> int:
    """A cheap, deliberately high prompt-size estimate (bytes / 3, a fixed cost per image)."""
    size = images = 0
    for msg in chat["messages"]:
        content = msg.get("content")
        if isinstance(content, str):
            size += len(content.encode())
        elif isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    images += 1
                else:
                    size += len(str(part.get("text", "")).encode())
        size += len(str(msg.get("reasoning") or "").encode()) + 16  # role markers
        for call in msg.get("tool_calls") or ():
            size += len(call["function"]["name"]) + len(call["function"]["arguments"]) + 16
    if "tools" in chat:
        size += len(orjson.dumps(chat["tools"]))
    return -(-size // BYTES_PER_TOKEN) + images * IMAGE_TOKENS


# -- messages ---------------------------------------------------------------------------------


def _messages(raw: Any, system: Any, model: Model, seal: ReasoningSeal) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise errors.invalid("'messages' must be a non-empty array.", param="messages")
    lead = [_system_text(system, "system")]
    out: list[dict[str, Any]] = []
    seen_assistant = False
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise errors.invalid(f"'{where}' must be an object with a role and content.", param=where)
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(content, (str, list)):
            raise errors.invalid(f"'{where}.content' must be a string or an array of blocks.", param=f"{where}.content")
        if role == "system":
            text = _system_text(content, f"{where}.content")
            if seen_assistant:  # a late system message: user text, which every template accepts
                _append(out, {"role": "user", "content": [{"type": "text", "text": text}]})
            else:
                lead.append(text)
        elif role == "user":
            for converted in _user(content, model):
                _append(out, converted)
        elif role == "assistant":
            seen_assistant = True
            _append(out, _assistant(content, where, seal))
        else:
            raise errors.invalid(f"'{where}.role' must be user or assistant; got {role!r}.", param=f"{where}.role")
    if not out:
        raise errors.invalid("'messages' must contain a user or assistant message.", param="messages")
    for msg in out:
        _finish_content(msg)
    head = "\n".join(t for t in lead if t)
    return ([{"role": "system", "content": head}] if head else []) + out


def _system_text(value: Any, where: str) -> str:
    """System text from a string or text blocks, without Claude Code's per-request billing header."""
    if value is None:
        return ""
    if isinstance(value, str):
        return "" if value.startswith(BILLING_PREFIX) else value
    if not isinstance(value, list):
        raise errors.invalid(f"'{where}' must be a string or an array of text blocks.", param=where)
    texts = []
    for block in value:
        text = block.get("text") if isinstance(block, dict) else None
        if not isinstance(text, str):
            raise errors.invalid(f"'{where}' blocks must be text blocks.", param=where)
        if not text.startswith(BILLING_PREFIX):
            texts.append(text)
    return "\n".join(texts)


def _append(out: list[dict[str, Any]], msg: dict[str, Any]) -> None:
    """Add a message, merging it into the previous one of the same role (templates want alternation)."""
    prev = out[-1] if out else None
    if prev is None or prev["role"] != msg["role"] or msg["role"] == "tool":
        out.append(msg)
        return
    prev["content"] += msg["content"]
    if msg.get("tool_calls"):
        prev["tool_calls"] = prev.get("tool_calls", []) + msg["tool_calls"]
    if msg.get("reasoning"):
        prev["reasoning"] = "\n".join(filter(None, (prev.get("reasoning"), msg["reasoning"])))


def _finish_content(msg: dict[str, Any]) -> None:
    """Parts lists -> the plain string most templates render when there is only text."""
    if msg["role"] == "tool":
        return
    parts: list[Part] = msg["content"]
    if any(p["type"] != "text" for p in parts):
        return
    text = "\n".join(p["text"] for p in parts)
    msg["content"] = None if not text and msg.get("tool_calls") else text
    if msg.get("reasoning"):
        msg["reasoning_content"] = msg["reasoning"]  # templates read one name or the other


def _blocks(content: Any, where: str = "messages") -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise errors.invalid(f"'{where}' content must be a string or an array of blocks.", param=where)
    return [b for b in content if isinstance(b, dict)]


def _user(content: Any, model: Model) -> list[dict[str, Any]]:
    """One Anthropic user turn -> tool messages first, then one user message with the rest."""
    tools: list[dict[str, Any]] = []
    parts: list[Part] = []
    late: list[Part] = []  # images from tool results go after the tool messages
    for block in _blocks(content):
        kind = block.get("type")
        if kind == "tool_result":
            text, images = _tool_result(block, model)
            tools.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
            late += images
        elif kind not in ("thinking", "redacted_thinking"):
            parts += _content_part(block, model)
    parts = late + parts
    return tools + ([{"role": "user", "content": parts}] if parts or not tools else [])


def _tool_result(block: dict[str, Any], model: Model) -> tuple[str, list[Part]]:
    content = block.get("content")
    texts: list[str] = []
    images: list[Part] = []
    for part in _blocks(content, "tool_result.content") if content is not None else ():
        for p in _content_part(part, model):
            if p["type"] == "text":
                texts.append(p["text"])
            else:
                images.append(p)
    text = "\n".join(texts)
    return ("Error: " + text if block.get("is_error") else text), images


def _content_part(block: dict[str, Any], model: Model) -> list[Part]:
    """A user-side content block as chat parts (text or image_url)."""
    kind = block.get("type")
    if kind == "text":
        return [{"type": "text", "text": str(block.get("text", ""))}]
    if kind == "image":
        return [_image(block.get("source"), model)]
    if kind == "document":
        return _document(block, model)
    if kind == "search_result":
        texts = [str(block.get("title") or "")] + [b.get("text", "") for b in _blocks(block.get("content") or [])]
        return [{"type": "text", "text": "\n".join(t for t in texts if t)}]
    if kind == "tool_reference":
        return [{"type": "text", "text": f"Tool loaded: {block.get('tool_name', '')}"}]
    return []  # server-tool results and the like: nothing the backend can use


def _image(source: Any, model: Model) -> Part:
    if not model.capabilities.image_input:
        log.info("image replaced by a placeholder: %s takes no image input", model.id)
        return {"type": "text", "text": f"[image omitted: {model.id} does not accept image input]"}
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media = source.get("media_type")
        if media not in _MEDIA:
            raise errors.invalid(f"Image media_type must be one of {', '.join(_MEDIA)}.", param="messages")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source.get('data', '')}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise errors.invalid("Image sources must be base64 or url; file sources are not supported.", param="messages")


def _document(block: dict[str, Any], model: Model) -> list[Part]:
    source: dict[str, Any] = block["source"] if isinstance(block.get("source"), dict) else {}
    title = block.get("title")
    head = f"{title}\n" if isinstance(title, str) and title else ""
    if source.get("type") == "text":
        return [{"type": "text", "text": head + str(source.get("data", ""))}]
    if source.get("type") == "content":
        parts = [p for b in _blocks(source.get("content") or []) for p in _content_part(b, model)]
        return ([{"type": "text", "text": head.rstrip()}] if head else []) + parts
    log.info("document replaced by a placeholder: %s cannot read PDF input", model.id)
    return [{"type": "text", "text": f"[document {head.strip()!r} omitted: {model.id} cannot read PDF input]"}]


def _assistant(content: Any, where: str, seal: ReasoningSeal) -> dict[str, Any]:
    texts: list[Part] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in _blocks(content):
        kind = block.get("type")
        if kind == "text":
            texts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "thinking":
            # The text the client saw, else what Kiln sealed in the signature (display "omitted").
            thought = block.get("thinking") or seal.open(block.get("signature"))
            if isinstance(thought, str) and thought:
                thoughts.append(thought)
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise errors.invalid(f"'{where}' has a tool_use block without a name.", param=where)
            arguments = orjson.dumps(block.get("input") or {}).decode()
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": name, "arguments": arguments}})
    msg: dict[str, Any] = {"role": "assistant", "content": texts}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning"] = "\n".join(thoughts)
    return msg


# -- tools and switches -----------------------------------------------------------------------


def _tool_references(messages: Any) -> set[str]:
    """Deferred tools loaded by a tool search earlier in the conversation."""
    names: set[str] = set()
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for block in content if isinstance(content, list) else ():
            inner = block.get("content") if isinstance(block, dict) and block.get("type") == "tool_result" else None
            if isinstance(inner, list):
                names.update(str(b.get("tool_name")) for b in inner
                             if isinstance(b, dict) and b.get("type") == "tool_reference")
    return names


def _tools(raw: Any, referenced: set[str]) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise errors.invalid("'tools' must be an array.", param="tools")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise errors.invalid(f"'tools[{i}]' needs a name.", param=f"tools[{i}]")
        if tool.get("type") not in (None, "custom"):
            continue  # a server or Anthropic-defined tool: the backend cannot run it
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise errors.invalid(f"'tools[{i}].input_schema' is required: a JSON Schema object.",
                                 param=f"tools[{i}].input_schema")
        if tool.get("defer_loading") and tool["name"] not in referenced:
            continue
        fn: dict[str, Any] = {"name": tool["name"], "parameters": {k: v for k, v in schema.items() if k != "$schema"}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(chat: dict[str, Any], choice: Any, names: set[str], model: Model) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise errors.invalid("'tool_choice.type' must be auto, any, tool or none.", param="tool_choice")
    if kind == "tool" and choice.get("name") not in names:
        return  # it pointed at a tool that was dropped (e.g. Claude Code's web_search)
    mode = {"auto": "auto", "none": "none", "any": "required", "tool": "named"}[kind]
    capabilities.require_tool_choice(model, mode, "tool_choice any" if kind == "any" else "a named tool_choice")
    chat["tool_choice"] = (
        {"type": "function", "function": {"name": choice["name"]}} if kind == "tool" else mode
    )
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _reasoning(chat: dict[str, Any], body: dict[str, Any], model: Model) -> bool:
    """Set the backend's reasoning switch from `thinking`; True if the client wants thinking blocks."""
    raw = body.get("thinking")
    thinking: dict[str, Any] = raw if isinstance(raw, dict) else {}
    kind = thinking.get("type")
    if raw is not None and kind not in ("enabled", "adaptive", "disabled"):
        raise errors.invalid("'thinking.type' must be enabled, adaptive or disabled.", param="thinking")
    wanted = kind in ("enabled", "adaptive")
    if not model.capabilities.reasoning:
        return wanted
    config = body.get("output_config")
    effort = _EFFORTS.get(str(config.get("effort"))) if isinstance(config, dict) else None
    if model.family == "gpt-oss":  # cannot be switched off; low is the least
        budget = thinking.get("budget_tokens") if kind == "enabled" else None
        if isinstance(budget, int) and effort is None:
            effort = "low" if budget < 8192 else "medium" if budget < 24576 else "high"
        if not wanted:
            effort = "low"
        if effort:
            chat["reasoning_effort"] = effort
    else:
        chat["chat_template_kwargs"] = {"enable_thinking": wanted}
    return wanted


def _output_format(chat: dict[str, Any], config: Any, model: Model) -> None:
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(fmt, dict):
        return
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise errors.invalid("'output_config.format' must be {type: json_schema, schema: {...}}.",
                             param="output_config.format")
    capabilities.require_structured_output(model, "output_config.format json_schema", "output_config.format")
    chat["response_format"] = {"type": "json_schema",
                               "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}

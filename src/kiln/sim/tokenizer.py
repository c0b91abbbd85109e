"""A deterministic toy tokenizer and a Qwen-like ChatML chat template.

The simulator must count tokens the same way for ``usage``, ``/tokenize`` and its
own output, so the gateway's token accounting can be checked exactly. Real
vocabularies are not needed for that; a regex splitter with hashed ids is enough:

* each word with its leading whitespace is one token (``" hello"``),
* each punctuation character with its leading whitespace is one token,
* a whitespace run right before a special token, or at the end of the text, is one token,
* the special tokens below are single tokens with fixed ids.

Ids are ``zlib.crc32(token) % 150000`` (special tokens use Qwen's ids above that
range). Ids are not reversible by themselves: every token the process has seen is
remembered in a bounded id->string table, which is what ``/detokenize`` uses. On a
hash collision the first string seen wins; unknown ids decode to ``""``.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

import orjson

VOCAB_SIZE = 150000
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|image_pad|>": 151655,
}
IMAGE_TOKENS = 85  # fixed cost of one image part, like a low-detail image
_IMAGE_TEXT = "<|image_pad|>" * IMAGE_TOKENS
_MAX_TABLE = 1_000_000

_SPECIAL_ALT = "|".join(re.escape(s) for s in SPECIAL_TOKENS)
_TOKEN_RE = re.compile(rf"{_SPECIAL_ALT}|\s+(?={_SPECIAL_ALT})|\s*\w+|\s*[^\w\s]|\s+\Z")
_findall = _TOKEN_RE.findall

_id_of: dict[str, int] = dict(SPECIAL_TOKENS)
_str_of: dict[int, str] = {v: k for k, v in SPECIAL_TOKENS.items()}

_TEXT_PARTS = {"text", "input_text", "output_text"}


def _learn(tok: str) -> int:
    """Hash a token never seen before and remember it (bounded) for detokenize."""
    tid = zlib.crc32(tok.encode()) % VOCAB_SIZE
    if len(_id_of) < _MAX_TABLE:
        _id_of[tok] = tid
        _str_of.setdefault(tid, tok)
    return tid


def split(text: str) -> list[str]:
    """Split text into token strings; ``"".join(split(t)) == t`` always holds."""
    return _findall(text)


def encode(text: str) -> list[int]:
    """Text -> token ids (the hot path: one regex pass and dict lookups)."""
    get = _id_of.get
    out = []
    append = out.append
    for tok in _findall(text):
        tid = get(tok)
        append(tid if tid is not None else _learn(tok))
    return out


def ids_of(pieces: list[str]) -> list[int]:
    """Token strings -> ids, for text already split with :func:`split`."""
    get = _id_of.get
    return [tid if (tid := get(p)) is not None else _learn(p) for p in pieces]


def count(text: str) -> int:
    """Number of tokens in ``text``."""
    return len(_findall(text))


def decode(ids: list[int]) -> str:
    """Token ids -> text, using the table of tokens seen so far."""
    get = _str_of.get
    return "".join(get(i, "") for i in ids)


def token_str(tid: int) -> str:
    """One id -> its string (``""`` when never seen)."""
    return _str_of.get(tid, "")


# --------------------------------------------------------------------------- chat template


def content_text(content: Any) -> str:
    """Message content -> template text: strings as-is, text parts joined by newlines,
    then 85 ``<|image_pad|>`` tokens per non-text part (appended after the text so
    each image adds exactly 85 tokens)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError("message content must be a string, null or a list of content parts")
    texts: list[str] = []
    images = 0
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ValueError("content parts must be objects")
        ptype = part.get("type")
        if ptype in _TEXT_PARTS or (ptype is None and "text" in part):
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("text content part needs a string `text`")
            texts.append(text)
        elif ptype == "refusal":
            texts.append(str(part.get("refusal") or ""))
        else:
            images += 1
    return "\n".join(texts) + _IMAGE_TEXT * images


def tool_call_json(name: str, arguments: Any) -> str:
    """Render one call the way Hermes/Qwen templates do (json.dumps default separators)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def render_chat(
    messages: list[Any], tools: list[Any] | None = None, add_generation_prompt: bool = True
) -> str:
    """Render messages (and tools) into the ChatML prompt the model would see.

    Raises ValueError for malformed messages (the server maps it to a 400).
    """
    parts: list[str] = []
    msgs = messages
    if tools:
        system = "# Tools\n" + "\n".join(orjson.dumps(t).decode() for t in tools)
        first = msgs[0] if msgs else None
        if isinstance(first, dict) and first.get("role") == "system":
            system = content_text(first.get("content")) + "\n\n" + system
            msgs = msgs[1:]
        parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for msg in msgs:
        if not isinstance(msg, dict):
            raise ValueError("each message must be an object")
        role = msg.get("role")
        if not isinstance(role, str):
            raise ValueError("each message needs a string `role`")
        text = content_text(msg.get("content"))
        calls = msg.get("tool_calls") if role == "assistant" else None
        if calls:
            if not isinstance(calls, list):
                raise ValueError("`tool_calls` must be a list")
            rendered = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    raise ValueError("each tool call needs a `function` object")
                rendered.append(
                    "<tool_call>" + tool_call_json(str(fn.get("name", "")), fn.get("arguments")) + "</tool_call>"
                )
            text = (text + "\n" if text else "") + "\n".join(rendered)
        parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)

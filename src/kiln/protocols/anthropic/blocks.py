"""Anthropic content blocks built from chat-completions output, with their SSE events.

One state machine serves both response forms: a stream feeds it deltas as
they arrive and sends the events it produces; a JSON response feeds it the
whole message at once and reads `content()`. So both forms agree on which
blocks exist and in what order (protocols.md §4.3, §5.6):

- one block open at a time; indexes contiguous from 0 in start order;
- a thinking block only when the client asked for thinking, closed by a
  `signature_delta`. The backend signs nothing; Kiln's signature is the
  thinking text sealed (compressed, HMAC-tagged, like Responses'
  `encrypted_content`), so a client that echoes the block back (they all
  must) gives the model its earlier reasoning again even when it never saw
  the text: with `display: "omitted"` the block carries no text, only the
  signature;
- a text block only once visible text arrives (whitespace before a tool call
  makes no empty block);
- a tool_use block only once its name is known; argument fragments go out
  as `input_json_delta`, verbatim, and backend tool-call ids pass through
  unchanged (some chat templates need their own id format back).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from kiln.protocols.base import new_id, sse_event
from kiln.protocols.reasoning import ReasoningSeal
from kiln.protocols.text_runs import Group, body_of, decode

log = logging.getLogger("kiln.messages")


@dataclass(slots=True)
class _Tool:
    id: str = ""
    name: str = ""
    index: int | None = None  # the Anthropic block index, once started
    pending: str = ""  # argument text that arrived before the name


class Blocks:
    def __init__(self, thinking: bool, seal: ReasoningSeal, show_thinking: bool = True,
                 single_tool_call: bool = False, stream: bool = False) -> None:
        self.thinking = thinking
        self.seal = seal
        self.show_thinking = show_thinking
        self.single_tool_call = single_tool_call  # keep only the first call (the model cannot be told)
        self.stream = stream  # a stream needs the events and only the deltas; a JSON answer the whole text
        self.blocks: list[dict[str, Any]] = []
        self.texts: dict[int, list[str]] = {}  # block index -> its text pieces (joined once, at the end)
        self.arguments: dict[int, str] = {}  # tool_use block index -> argument JSON text
        self._open: str | None = None  # "thinking", "text" or "tool"
        self._tools: dict[int, _Tool] = {}  # by the backend's tool-call index
        self._held = ""  # whitespace not yet in a block
        self._out: list[bytes] = []

    @property
    def has_tool_use(self) -> bool:
        return bool(self.arguments)

    def take(self) -> bytes:
        """The events produced since the last call."""
        out, self._out = b"".join(self._out), []
        return out

    def reasoning(self, text: str) -> None:
        if not self.thinking or not text:
            return
        if self._open != "thinking":
            self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self.texts.setdefault(len(self.blocks) - 1, []).append(text)  # always: the signature seals it
        if self.show_thinking:
            self._delta({"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> None:
        if not text:
            return
        if self._open != "text":
            text = self._held + text
            if not text.strip():
                self._held = text
                return
            self._held = ""
            self._start("text", {"type": "text", "text": ""})
        if not self.stream:
            self.texts.setdefault(len(self.blocks) - 1, []).append(text)
            return
        # The most frequent event of all: its bytes from a template, not a dict.
        self._out.append(_TEXT_HEAD % (len(self.blocks) - 1) + body_of(text) + _TEXT_TAIL)

    def text_run(self, groups: list[Group]) -> None:
        """Text deltas in a row, as TextRuns gives them: what `reasoning` and `text` do for each,
        with the answer's deltas written from their JSON bodies as they came, once its block is open."""
        for name, bodies in groups:
            if name != "content":
                for body in bodies:
                    self.reasoning(decode([body]))
                continue
            k = 0
            while k < len(bodies) and self._open != "text":  # whitespace alone opens no block: one by one
                self.text(decode([bodies[k]]))
                k += 1
            if k < len(bodies):
                run = bodies[k:] if k else bodies
                index = len(self.blocks) - 1
                if not self.stream:
                    self.texts[index].append(decode(run))
                    continue
                head = _TEXT_HEAD % index
                self._out.append(head + (_TEXT_TAIL + head).join(run) + _TEXT_TAIL)

    def tool_call(self, entry: dict[str, Any]) -> None:
        """One `tool_calls` delta entry (several may share an index; the name may come first)."""
        position = entry.get("index", 0)
        position = position if isinstance(position, int) else 0
        if self.single_tool_call and position != 0:
            return
        tool = self._tools.setdefault(position, _Tool())
        tool.id = tool.id or str(entry.get("id") or "")
        fn = entry.get("function") or {}
        tool.name = tool.name or str(fn.get("name") or "")
        tool.pending += fn.get("arguments") or ""
        if tool.index is None:
            if not tool.name:
                return
            self._start("tool", {"type": "tool_use", "id": tool.id or new_id("toolu_"), "name": tool.name, "input": {}})
            tool.index = len(self.blocks) - 1
            self.arguments[tool.index] = ""
        if tool.pending:
            # Backends send one call after another; a late fragment still goes to its own block.
            self.arguments[tool.index] += tool.pending
            self._delta({"type": "input_json_delta", "partial_json": tool.pending}, tool.index)
            tool.pending = ""

    def close(self) -> None:
        if self._open is None:
            return
        index = len(self.blocks) - 1
        if self._open == "thinking":
            signature = self.seal.seal("".join(self.texts.get(index, ())))
            self.blocks[index]["signature"] = signature
            self._delta({"type": "signature_delta", "signature": signature})
        if self.stream:
            self._out.append(_BLOCK_STOP % index)
        self._open = None

    def content(self) -> list[dict[str, Any]]:
        """The finished blocks as a Messages response carries them (tool input parsed)."""
        self.close()
        out = []
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = {**block, "input": _parse_input(self.arguments[index], block["name"])}
            elif index in self.texts and (block["type"] == "text" or self.show_thinking):
                block = {**block, block["type"]: "".join(self.texts[index])}
            out.append(block)
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> None:
        self.close()
        self._open = kind
        self.blocks.append(block)
        if not self.stream:
            return
        if kind == "text":
            self._out.append(_TEXT_START % (len(self.blocks) - 1))
        else:
            start = {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}
            self._out.append(sse_event("content_block_start", start))

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> None:
        if not self.stream:  # a JSON answer: the blocks are read whole, by content()
            return
        at = len(self.blocks) - 1 if index is None else index
        self._out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": at, "delta": delta}))


# The events of a text block, from bytes (a dict and an orjson call each cost several times more):
# its start, a delta around its JSON string body, and the stop every block ends with.
_TEXT_START = (b'event: content_block_start\ndata: {"type":"content_block_start","index":%d,'
               b'"content_block":{"type":"text","text":""}}\n\n')
_BLOCK_STOP = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":%d}\n\n'
_TEXT_HEAD = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
              b'"delta":{"type":"text_delta","text":"')
_TEXT_TAIL = b'"}}\n\n'


def _parse_input(arguments: str, name: str) -> dict[str, Any]:
    """Tool arguments as the object Anthropic clients expect; {} if the model produced no valid object."""
    if not arguments.strip():
        return {}
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    log.warning("tool call %s had arguments that are not a JSON object; sent as {}", name)
    return {}

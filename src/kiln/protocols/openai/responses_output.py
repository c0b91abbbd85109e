"""Chat-completion output -> Responses output items and stream events.

One `Items` object builds the final items for both paths (JSON and SSE),
so a streamed response ends with exactly the items a JSON one would hold.
`EventStream` is the state machine of protocols.md 5.7: one item open at a
time, `output_item.added` before any delta (Codex fails a turn on a text
delta without an active item), every item closed with `output_item.done`
(Codex builds its history only from those), `sequence_number` on every
event, and a final `response.completed` / `.incomplete` / `.failed`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from kiln.protocols.base import new_id, sse_event
from kiln.protocols.chat_backed import text_of, tool_calls_of
from kiln.protocols.reasoning import ReasoningSeal
from kiln.protocols.text_runs import Group, body_of, decode

log = logging.getLogger("kiln.responses")


@dataclass
class Items:
    """Final-form output items, shaped by what the request asked for."""

    custom_tools: frozenset[str]
    seal: ReasoningSeal | None  # set when the client asked for reasoning.encrypted_content
    summary: bool
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # backend name -> (namespace, name)

    def reasoning(self, item_id: str, text: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [{"type": "summary_text", "text": text}] if self.summary else [],
            "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": self.seal.seal(text) if self.seal is not None else None,
        }

    @staticmethod
    def message(item_id: str, text: str) -> dict[str, Any]:
        return {
            "type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }

    def tool_call(self, call_id: str, name: str, arguments: str) -> dict[str, Any]:
        if name in self.custom_tools:
            return {"type": "custom_tool_call", "id": new_id("ctc_"), "status": "completed",
                    "call_id": call_id, "name": name, "input": custom_input(arguments)}
        return self.named({"type": "function_call", "id": new_id("fc_"), "status": "completed",
                           "call_id": call_id, "name": name, "arguments": arguments})

    def named(self, item: dict[str, Any]) -> dict[str, Any]:
        """A function call of a namespace's tool under the client's own names (namespace, name)."""
        names = self.namespaced.get(item["name"])
        if names is not None:
            item["namespace"], item["name"] = names
        return item

    def from_message(self, message: dict[str, Any], single_tool_call: bool) -> list[dict[str, Any]]:
        """Items of a non-streamed chat message, in the order reasoning, text, tool calls."""
        items = []
        thought = text_of(message, "reasoning", "reasoning_content")
        if thought:
            items.append(self.reasoning(new_id("rs_"), thought))
        text = text_of(message, "content")
        if text:
            items.append(self.message(new_id("msg_"), text))
        calls = tool_calls_of(message)
        for call in calls[:1] if single_tool_call else calls:
            fn = call["function"]
            call_id = call.get("id")
            items.append(self.tool_call(call_id if isinstance(call_id, str) and call_id else new_id("call_"),
                                        fn.get("name") or "", fn.get("arguments") or "{}"))
        return items


def custom_input(arguments: str) -> str:
    """The raw input of a freeform tool, unwrapped from the one-parameter function call."""
    try:
        args = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(args, dict):
        if isinstance(args.get("input"), str):
            return str(args["input"])
        strings = [v for v in args.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
    return arguments


@dataclass
class _Call:
    """A tool call being streamed, keyed by its chat index."""

    call_id: str = ""
    name: str = ""
    arguments: str = ""
    item_id: str = ""
    output_index: int = -1
    closed: bool = False


# The events of a text answer, from bytes: a dict and an orjson call each cost several times more,
# and the texts are JSON string bodies already (text_runs.py). Keys in the order `event()` writes them.
# In parts, for a run of deltas: its start, the item's fields (filled in once per run), its end.
_DELTA_START = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","sequence_number":'
_DELTA_ITEM = b',"item_id":"%b","output_index":%d,"content_index":0,"delta":"'
_DELTA_END = b'","logprobs":[]}\n\n'
_DELTA_JOIN = _DELTA_END + _DELTA_START
_TEXT_DELTA = _DELTA_START + b"%d" + _DELTA_ITEM + b"%b" + _DELTA_END
_HEAD = (b'event: response.created\ndata: {"type":"response.created","sequence_number":%d,"response":%b}\n\n'
         b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":%d,"response":%b}\n\n')
_MESSAGE_ADDED = (
    b'event: response.output_item.added\ndata: {"type":"response.output_item.added","sequence_number":%d,'
    b'"output_index":%d,"item":{"type":"message","id":"%b","status":"in_progress","role":"assistant","content":[]}}\n\n'
    b'event: response.content_part.added\ndata: {"type":"response.content_part.added","sequence_number":%d,'
    b'"item_id":"%b","output_index":%d,"content_index":0,'
    b'"part":{"type":"output_text","text":"","annotations":[],"logprobs":[]}}\n\n')
_OUTPUT_TEXT = b'{"type":"output_text","text":"%b","annotations":[],"logprobs":[]}'
_MESSAGE = b'{"type":"message","id":"%b","status":"completed","role":"assistant","content":[%b]}'
_MESSAGE_DONE = (
    b'event: response.output_text.done\ndata: {"type":"response.output_text.done","sequence_number":%d,'
    b'"item_id":"%b","output_index":%d,"content_index":0,"text":"%b","logprobs":[]}\n\n'
    b'event: response.content_part.done\ndata: {"type":"response.content_part.done","sequence_number":%d,'
    b'"item_id":"%b","output_index":%d,"content_index":0,"part":%b}\n\n'
    b'event: response.output_item.done\ndata: {"type":"response.output_item.done","sequence_number":%d,'
    b'"output_index":%d,"item":%b}\n\n')
_FINAL = b'event: %b\ndata: {"type":"%b","sequence_number":%d,"response":%b}\n\n'


@dataclass
class _Open:
    kind: str  # "reasoning" | "message" | "function" | "custom"
    item_id: str
    output_index: int
    text: list[bytes] = field(default_factory=list)  # JSON string bodies (text_runs.py), decoded at the close
    call: _Call | None = None


class EventStream:
    """Chat-completion stream chunks in, Responses events out.

    `head` is the response object as it stands before any output, encoded
    once: `response.created` and `response.in_progress` both carry it, and a
    keepalive carries only the few fields that identify the response (Codex
    resets its idle timer on any event; SDKs keep their snapshot).
    """

    def __init__(self, items: Items, head: bytes, single_tool_call: bool) -> None:
        self.items = items
        self.head: bytes | None = head  # dropped once sent: tens of KB with an agent's tools
        self.single_tool_call = single_tool_call
        self.seq = 0
        self.started = False
        self.output: list[dict[str, Any] | orjson.Fragment] = []  # closed items, in output_index order
        self.finish_reason: str | None = None
        self._open: _Open | None = None
        self._added = 0  # output indexes handed out
        self._calls: dict[int, _Call] = {}

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, data)

    def start(self) -> bytes:
        """response.created + response.in_progress, once."""
        if self.started:
            return b""
        self.started = True
        head, self.head = self.head, None
        seq, self.seq = self.seq, self.seq + 2
        return _HEAD % (seq, head, seq + 1, head)

    def final(self, kind: str, response: bytes) -> bytes:
        """The last event: `kind` (response.completed, .incomplete or .failed) with the response object."""
        seq, self.seq = self.seq, self.seq + 1
        name = kind.encode()
        return _FINAL % (name, name, seq, response)

    def keepalive(self, alive: dict[str, Any]) -> bytes:
        """The smallest event that resets Codex's stream idle timer (an SSE comment does not):
        the head if it has not gone out, else response.in_progress with `alive` as the response."""
        return self.start() or self.event("response.in_progress", response=alive)

    def feed(self, choice: dict[str, Any], delta: dict[str, Any]) -> tuple[bytes, bool]:
        """One choice of a chat chunk: the events, and whether it carried output."""
        out = [self.start()]
        thought = text_of(delta, "reasoning", "reasoning_content")
        if thought:
            out.append(self._text("reasoning", thought))
        text = text_of(delta, "content")
        if text:
            out.append(self._text("message", text))
        calls = tool_calls_of(delta)
        for entry in calls:
            out.append(self._tool_delta(entry))
        if isinstance(choice.get("finish_reason"), str):
            self.finish_reason = choice["finish_reason"]
        return b"".join(out), bool(thought or text or calls)

    def text_run(self, groups: list[Group]) -> bytes:
        """Text deltas in a row, as TextRuns gives them: what `feed` makes of each, with the
        answer's deltas written from their JSON bodies as they came, once its item is open."""
        out: list[bytes] = []
        for name, bodies in groups:
            if name != "content":
                out += [self._text("reasoning", decode([body]), body) for body in bodies]
                continue
            item = self._open
            if item is None or item.kind != "message":
                out.append(self._close() + self._add("message"))
                item = self._open
                assert item is not None
            item.text.extend(bodies)
            seq, self.seq = self.seq, self.seq + len(bodies)
            if len(bodies) == 1:  # a lone delta (a paced stream's every read): the one-event template
                out.append(_TEXT_DELTA % (seq, item.item_id.encode(), item.output_index, bodies[0]))
                continue
            # The item's fields filled in once: each delta then formats its number and its text,
            # and the events are joined around the ends they share.
            fields = (_DELTA_ITEM % (item.item_id.encode(), item.output_index)).replace(b"%", b"%%")
            middle = b"%d" + fields + b"%b"
            deltas = [middle % (seq + k, body) for k, body in enumerate(bodies)]
            out.append(_DELTA_START + _DELTA_JOIN.join(deltas) + _DELTA_END)
        return b"".join(out)

    def close(self) -> bytes:
        """Close the item still open at the end of the generation."""
        return self._close()

    # -- items -------------------------------------------------------------

    def _text(self, kind: str, delta: str, body: bytes | None = None) -> bytes:
        """A text delta of an item of `kind`; `body`: the delta as a JSON string body, if known."""
        out = b""
        if self._open is None or self._open.kind != kind:
            out = self._close() + self._add(kind)
        item = self._open
        assert item is not None
        if body is None:
            body = body_of(delta)
        item.text.append(body)
        if kind == "message":  # the most frequent event of all: its bytes from a template, not a dict
            seq, self.seq = self.seq, self.seq + 1
            return out + _TEXT_DELTA % (seq, item.item_id.encode(), item.output_index, body)
        base = {"item_id": item.item_id, "output_index": item.output_index}
        out += self.event("response.reasoning_text.delta", **base, content_index=0, delta=delta)
        if self.items.summary:
            out += self.event("response.reasoning_summary_text.delta", **base, summary_index=0, delta=delta)
        return out

    def _add(self, kind: str) -> bytes:
        item_id = new_id("rs_" if kind == "reasoning" else "msg_")
        self._open = _Open(kind, item_id, self._added)
        self._added += 1
        index = self._open.output_index
        if kind == "message":
            seq, self.seq = self.seq, self.seq + 2
            ident = item_id.encode()
            return _MESSAGE_ADDED % (seq, index, ident, seq + 1, ident, index)
        base = {"item_id": item_id, "output_index": index}
        item = {"type": "reasoning", "id": item_id, "summary": [], "content": [], "encrypted_content": None}
        out = (self.event("response.output_item.added", output_index=index, item=item)
               + self.event("response.content_part.added", **base, content_index=0,
                            part={"type": "reasoning_text", "text": ""}))
        if self.items.summary:
            out += self.event("response.reasoning_summary_part.added", **base, summary_index=0,
                              part={"type": "summary_text", "text": ""})
        return out

    def _tool_delta(self, entry: dict[str, Any]) -> bytes:
        index = entry.get("index", 0)
        index = index if isinstance(index, int) else 0
        if self.single_tool_call and index != 0:
            return b""
        call = self._calls.setdefault(index, _Call())
        fn = entry["function"]
        call_id = entry.get("id")
        call.call_id = call_id if isinstance(call_id, str) and call_id else call.call_id
        call.name = fn.get("name") or call.name
        piece = fn.get("arguments") or ""
        if call.closed:
            if piece:
                log.warning("dropped a late arguments fragment for tool call %s", call.call_id)
            return b""
        call.arguments += piece
        if not call.name:
            return b""  # id or arguments before the name: wait for it
        out = b""
        if self._open is None or self._open.call is not call:
            out = self._close() + self._open_call(call)
            piece = call.arguments  # everything buffered so far
        if self._open is not None and self._open.kind == "function" and piece:
            out += self.event("response.function_call_arguments.delta", item_id=call.item_id,
                              output_index=call.output_index, delta=piece)
        return out

    def _open_call(self, call: _Call) -> bytes:
        """Open a tool call; a custom tool's input is only known once its JSON is complete."""
        call.call_id = call.call_id or new_id("call_")
        call.output_index = self._added
        self._added += 1
        custom = call.name in self.items.custom_tools
        call.item_id = new_id("ctc_" if custom else "fc_")
        self._open = _Open("custom" if custom else "function", call.item_id, call.output_index, call=call)
        if custom:
            return b""
        item = self.items.named({"type": "function_call", "id": call.item_id, "status": "in_progress",
                                 "call_id": call.call_id, "name": call.name, "arguments": ""})
        return self.event("response.output_item.added", output_index=call.output_index, item=item)

    def _close(self) -> bytes:
        item = self._open
        if item is None:
            return b""
        self._open = None
        if item.kind == "message":
            return self._close_message(item)
        base = {"item_id": item.item_id, "output_index": item.output_index}
        out = b""
        if item.kind == "reasoning":
            text = decode(item.text)
            done = self.items.reasoning(item.item_id, text)
            out += (self.event("response.reasoning_text.done", **base, content_index=0, text=text)
                    + self.event("response.content_part.done", **base, content_index=0,
                                 part={"type": "reasoning_text", "text": text}))
            if self.items.summary:
                summary = {"type": "summary_text", "text": text}
                out += (self.event("response.reasoning_summary_text.done", **base, summary_index=0, text=text)
                        + self.event("response.reasoning_summary_part.done", **base, summary_index=0, part=summary))
        else:
            call = item.call
            assert call is not None
            call.closed = True
            done = self.items.tool_call(call.call_id, call.name, call.arguments)
            done["id"] = item.item_id
            if item.kind == "custom":
                added = {**done, "status": "in_progress", "input": ""}
                out += (self.event("response.output_item.added", output_index=item.output_index, item=added)
                        + self.event("response.custom_tool_call_input.delta", **base, delta=done["input"])
                        + self.event("response.custom_tool_call_input.done", **base, input=done["input"]))
            else:
                out += self.event("response.function_call_arguments.done", **base, name=done["name"],
                                  arguments=call.arguments)
        self.output.append(done)
        return out + self.event("response.output_item.done", output_index=item.output_index, item=done)

    def _close_message(self, item: _Open) -> bytes:
        """The three events that close a message, written from its text's JSON string bodies as
        they came (each valid on its own, so their concatenation is one): no decode, no re-encode."""
        body, ident, index = b"".join(item.text), item.item_id.encode(), item.output_index
        part = _OUTPUT_TEXT % body
        done = _MESSAGE % (ident, part)
        self.output.append(orjson.Fragment(done))
        seq, self.seq = self.seq, self.seq + 3
        return _MESSAGE_DONE % (seq, ident, index, body, seq + 1, ident, index, part, seq + 2, index, done)

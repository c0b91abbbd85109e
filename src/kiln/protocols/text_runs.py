"""Runs of plain text deltas in a backend's chat stream, read without parsing each one.

Most of a stream is chunks that differ from each other only in the text they carry
(and, with continuous usage stats, in their `usage`): vLLM writes

    {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",
     "choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null}]}

for every token. `TextRuns` parses one such chunk fully, learns its bytes around the text
(the *skeleton*), and reads the next chunks by comparing bytes: a payload that starts with
the skeleton's prefix and ends with its tail is the same JSON with another string in the
same place, as long as what lies between is a valid JSON string body. That is checked for a
whole run at once (one search for a quote, a backslash or a control character over the
texts joined; one escape-aware parse only for a text that has one), and a usage object
between the tail's fixed part and the closing brace is parsed with the run's others in one
call. The first payload that does not fit ends the fast path; it is parsed like any other,
and a plain text delta teaches a new skeleton (a few times per stream at most: a backend
whose chunks differ elsewhere, such as a changing `created`, keeps the parsed path).

Texts come out as JSON string bodies (escaped, without their quotes): a translator writes
them into its own events as they are, and decodes them only where it needs the text.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kiln.core.records import Usage

TEXT_KEYS = ("content", "reasoning", "reasoning_content")  # a delta's text: the answer, or its reasoning
Group = tuple[str, list[bytes]]  # a field (one of TEXT_KEYS) and the JSON string bodies of its deltas in a row

_UNSAFE = re.compile(rb'["\\\x00-\x1f]')  # what a string body must escape (or must not hold bare)
_USAGE = b',"usage":'
_NOT_BRACE = bytes(b for b in range(256) if b not in b"{}\x00")  # deleted, what is left of flat usages
_FLAT, _BETWEEN = b"{}\x00", b"}\x00{"  # is one `{}` each, and NUL between them
_LEARNS = 8  # skeletons learned per stream at most


def decode(bodies: list[bytes]) -> str:
    """The text of JSON string bodies in a row (each one valid on its own)."""
    return orjson.loads(b'"' + b"".join(bodies) + b'"')  # type: ignore[no-any-return]


def body_of(text: str) -> bytes:
    """A text as a JSON string body."""
    return orjson.dumps(text)[1:-1]


class _Skeleton:
    """The bytes of a plain text chunk around its text: `prefix` up to the string's first
    character, `tail` from its closing quote (with usage: up to the usage value, which the
    payload's closing brace follows)."""

    __slots__ = ("field", "prefix", "tail", "usage")

    def __init__(self, field: str, prefix: bytes, tail: bytes, usage: bool) -> None:
        self.field, self.prefix, self.tail, self.usage = field, prefix, tail, usage

    def scan(self, payloads: list[bytes], start: int, end: int,
             bodies: list[bytes], usages: list[bytes]) -> int:
        """Payloads from `start` that fit (their bodies and usage values appended); how many."""
        prefix, tail, lp = self.prefix, self.tail, len(self.prefix)
        i = start
        if self.usage:
            while i < end:
                p = payloads[i]
                if not p.startswith(prefix) or p[-1:] != b"}":
                    break
                at = p.find(tail, lp)
                if at <= lp:
                    break
                bodies.append(p[lp:at])
                usages.append(p[at + len(tail):-1])
                i += 1
            return i - start
        least, lt = lp + len(tail), -len(tail)
        while i < end:
            p = payloads[i]
            if len(p) <= least or not p.startswith(prefix) or not p.endswith(tail):
                break
            bodies.append(p[lp:lt])
            i += 1
        return i - start


def _learn(payload: bytes, field: str, text: str, usage: Any) -> _Skeleton | None:
    """The skeleton of a plain text chunk, or None if its bytes are not laid out as expected."""
    opening = b'"delta":{"' + field.encode() + b'":"'
    start = payload.find(opening)
    if start < 0:
        return None
    start += len(opening)
    end = start
    while True:  # the closing quote: the first one not escaped
        end = payload.find(b'"', end)
        if end < 0:
            return None
        slashes = end - len(payload[start:end].rstrip(b"\\")) - start
        if not slashes % 2:
            break
        end += 1
    try:
        if orjson.loads(payload[start - 1:end + 1]) != text:
            return None
    except orjson.JSONDecodeError:
        return None
    if usage is None:
        return _Skeleton(field, payload[:start], payload[end:], False)
    at = payload.rfind(_USAGE)
    if at < end or payload[-1:] != b"}":
        return None
    try:
        if orjson.loads(payload[at + len(_USAGE):-1]) != usage:
            return None
    except orjson.JSONDecodeError:
        return None
    return _Skeleton(field, payload[:start], payload[end:at + len(_USAGE)], True)


def _plain(payload: bytes) -> tuple[str, str, Any] | None:
    """(field, text, usage or None) of a chat chunk that is one plain text delta: one choice,
    its delta one text field holding a non-empty string, no finish reason. Else None.

    The chunks that end a run (the finish reason, the usage chunk, the end, an error) are
    known by a marker before any parse: the caller parses them anyway. A marker's quotes
    cannot be text the model wrote (JSON escapes those); one elsewhere only costs the parse."""
    if (payload[:1] != b"{" or payload.startswith(b'{"error"') or payload.find(b'"finish_reason":"') >= 0
            or payload.find(b'"choices":[]') >= 0):  # find, not `in`: see kiln.upstream.SSEParser.feed
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return _plain_data(data)


def _plain_data(data: Any) -> tuple[str, str, Any] | None:
    """What `_plain` says of a chunk already parsed."""
    choices = data.get("choices") if type(data) is dict else None
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    if type(choice) is not dict or choice.get("finish_reason") is not None:
        return None
    delta = choice.get("delta")
    if type(delta) is not dict or len(delta) != 1:
        return None
    field, text = next(iter(delta.items()))
    if field not in TEXT_KEYS or type(text) is not str or not text:
        return None
    return field, text, data.get("usage")


def _valid(bodies: list[bytes], usages: list[bytes]) -> tuple[int, Any]:
    """How many of a scanned run are valid from the first (string bodies, usage objects), and
    the last valid one's usage (None without usage)."""
    good = len(bodies)
    joined = b"".join(bodies)
    if not joined.isascii() or _UNSAFE.search(joined) is not None:
        for k, body in enumerate(bodies):
            if not _string_body(body):
                good = k
                break
    if not usages or not good:
        return good, None
    return _usages(usages, good)


def _string_body(body: bytes) -> bool:
    """Whether `body` is one valid JSON string body: ASCII without a quote, a backslash or a
    control character is; anything else is what a parse of it as a string says."""
    if body.isascii() and _UNSAFE.search(body) is None:
        return True
    try:
        orjson.loads(b'"' + body + b'"')
    except orjson.JSONDecodeError:
        return False
    return True


def _usages(usages: list[bytes], good: int) -> tuple[int, Any]:
    """How many of a run's first `good` usage values are objects from the first, and the last one.

    Only the last is parsed: the run reports the latest count. Each of the others must be one
    flat object: `{` first, `}` last, no brace between (two C passes over all of them, half of
    what parsing them costs). Its payload is then the skeleton's chunk with that usage, or not
    JSON at all, which is taken like a valid one since nothing in it is used (the full path
    would have refused it): valid JSON is never read otherwise than a parse reads it, as a
    value that closes the usage and adds a key needs a brace of its own. Usages with nested
    objects (vLLM's `prompt_tokens_details`) are parsed whole."""
    joined = b"\x00".join(usages[:good])  # NUL: JSON never holds one raw
    if (joined[:1] == b"{" and joined[-1:] == b"}" and joined.count(_BETWEEN) == good - 1
            and joined.translate(None, _NOT_BRACE) == _FLAT * (good - 1) + b"{}"):
        try:
            last = orjson.loads(usages[good - 1])
        except orjson.JSONDecodeError:
            last = None
        if type(last) is dict:
            return good, last
    try:
        parsed = orjson.loads(b"[" + b",".join(usages[:good]) + b"]")
    except orjson.JSONDecodeError:
        parsed = None
    if type(parsed) is list and len(parsed) == good and all(type(u) is dict for u in parsed):
        return good, parsed[-1]
    for k, raw in enumerate(usages[:good]):  # rare: find the first that is not an object
        try:
            usage = orjson.loads(raw)
        except orjson.JSONDecodeError:
            usage = None
        if type(usage) is not dict:
            return k, (orjson.loads(usages[k - 1]) if k else None)
    return good, None  # unreachable: the joined parse failed, so one of them is not an object


class TextRuns:
    """A stream's reader of plain text runs (one per translator, per request)."""

    __slots__ = ("_skeleton", "_learns")

    def __init__(self) -> None:
        self._skeleton: _Skeleton | None = None
        self._learns = 0

    def take(self, payloads: list[bytes], start: int, most: int) -> tuple[list[Group], Usage | None, int]:
        """The run of plain text deltas from `start` (at most `most`): their texts grouped by
        field in order, the usage the last of them reported (continuous usage stats put one on
        every chunk), and how many. The first payload that is anything else ends the run; the
        caller takes it on its own, where every check and error of the full path applies."""
        groups: list[Group] = []
        usage: Any = None
        end = min(len(payloads), start + most)
        i = start
        while i < end:
            skeleton = self._skeleton
            if skeleton is not None:
                bodies: list[bytes] = []
                usages: list[bytes] = []
                if skeleton.scan(payloads, i, end, bodies, usages):
                    good, last = _valid(bodies, usages)
                    if good:
                        _add(groups, skeleton.field, bodies[:good])
                        usage = last if skeleton.usage else usage
                        i += good
                        continue
            plain = _plain(payloads[i])
            if plain is None:
                break
            field, text, reported = plain
            _add(groups, field, [body_of(text)])
            if reported is not None:
                usage = reported
            self._teach(payloads[i], plain)  # it did not fit the skeleton (if any): learn from it
            i += 1
        return groups, Usage.from_openai(usage) if usage is not None else None, i - start

    def one(self, payload: bytes) -> tuple[str, bytes, Usage | None] | None:
        """A read of one payload (how a paced stream comes: a token a read) checked against
        the skeleton as `take` checks each payload of a run, without a run's lists and joins:
        (field, its text as a JSON string body, the usage it reported), or None when it does
        not fit or no skeleton is learned yet (the caller parses it, then calls `learn`)."""
        skeleton = self._skeleton
        if skeleton is None or not payload.startswith(skeleton.prefix):
            return None
        lp, tail = len(skeleton.prefix), skeleton.tail
        raw = b""
        if skeleton.usage:
            at = payload.find(tail, lp)
            if at <= lp or payload[-1:] != b"}":
                return None
            body, raw = payload[lp:at], payload[at + len(tail):-1]
        elif len(payload) > lp + len(tail) and payload.endswith(tail):
            body = payload[lp:-len(tail)]
        else:
            return None
        if not _string_body(body):
            return None
        if not skeleton.usage:
            return skeleton.field, body, None
        try:
            usage = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if type(usage) is not dict:
            return None
        return skeleton.field, body, Usage.from_openai(usage)

    def learn(self, payload: bytes, data: Any) -> None:
        """After a lone payload was parsed the full way: learn its skeleton if it is a plain
        text delta (what `take` does for a payload of a run that did not fit)."""
        if self._learns < _LEARNS:
            plain = _plain_data(data)
            if plain is not None:
                self._teach(payload, plain)

    def _teach(self, payload: bytes, plain: tuple[str, str, Any]) -> None:
        """A new skeleton from a plain text delta (kept the old one if its bytes do not fit), a
        few times per stream at most."""
        if self._learns < _LEARNS:
            self._learns += 1
            field, text, reported = plain
            self._skeleton = _learn(payload, field, text, reported) or self._skeleton


def _add(groups: list[Group], field: str, bodies: list[bytes]) -> None:
    if groups and groups[-1][0] == field:
        groups[-1][1].extend(bodies)
    else:
        groups.append((field, bodies))

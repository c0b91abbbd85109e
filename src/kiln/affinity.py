"""Prefix-cache affinity: which requests belong together, and which backend takes them.

Agent turns resend a growing prefix, and the replica that served the last
turn holds it in its KV cache. `affinity_key` names the conversation a
request belongs to, from what clients send (pure functions of the parsed
body, the endpoint and the headers). `Ring` places keys on a model's
backends by consistent hashing; the router takes the first backend on the
ring whose load is under its bound (bounded-load consistent hashing, Mirrokni
et al. 2018), so a hot session spills over instead of overloading one
replica. Nothing is stored per session: memory does not grow with traffic.
"""

from __future__ import annotations

import bisect
import hashlib
import re
from typing import Any, Iterator, Mapping, Sequence

import orjson

from kiln.catalog import Backend
from kiln.protocols.anthropic.request import BILLING_PREFIX

PART_BYTES = 2048  # of each prompt part hashed when a request names no session
VNODES = 64  # ring points per unit of weight
SESSION_HEADER = "x-claude-code-session-id"
_LEGACY_SESSION = re.compile(r"_session_([0-9a-fA-F-]{8,})$")
# Per endpoint: the fields that open the prompt, in prompt order. The last one is the
# conversation, of which only the turns up to the first user message are taken.
_PROMPT_FIELDS = {
    "chat.completions": ("tools", "messages"),
    "completions": ("prompt",),
    "responses": ("instructions", "tools", "input"),
    "messages": ("system", "tools", "messages"),
}


def affinity_key(body: Any, endpoint: str, headers: Mapping[str, str]) -> str | None:
    """The routing key of a request, from the most to the least specific signal.

    Codex's `prompt_cache_key` (its thread id), then the Claude Code session
    (`metadata.user_id`, or the `X-Claude-Code-Session-Id` header), then the
    end user (`safety_identifier`, `user`, another client's `metadata.user_id`),
    else a digest of the prompt's opening (system, tools, first user turn).
    """
    if not isinstance(body, dict):
        return None
    cache_key = body.get("prompt_cache_key")
    if _named(cache_key):
        return "cache:" + cache_key
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) and endpoint == "messages" else None
    session = claude_code_session(user_id) or headers.get(SESSION_HEADER)
    if _named(session):
        return "session:" + session
    for name in ("safety_identifier", "user"):
        if _named(body.get(name)):
            return "user:" + body[name]
    if _named(user_id):
        return "user:" + user_id
    digest = prompt_digest(body, endpoint)
    return None if digest is None else "prefix:" + digest


def claude_code_session(user_id: Any) -> str | None:
    """The session id in Claude Code's `metadata.user_id`.

    Since 2.1.78 it is a JSON string `{"device_id", "account_uuid", "session_id"}`;
    before, `user_<sha256>_account_<uuid>_session_<uuid>`.
    """
    if not isinstance(user_id, str):
        return None
    if user_id.startswith("{"):
        try:
            data = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            return None
        session = data.get("session_id") if isinstance(data, dict) else None
        return session if _named(session) else None
    m = _LEGACY_SESSION.search(user_id)
    return m.group(1) if m else None


def prompt_digest(body: dict[str, Any], endpoint: str) -> str | None:
    """A digest of the first PART_BYTES of each part that opens the prompt, or None if it is empty.

    Only what stays the same from turn to turn is taken: the conversation up
    to its first user message, without `cache_control` marks (clients move
    them) and without Claude Code's billing header (it changes every request).
    """
    fields = _PROMPT_FIELDS.get(endpoint)
    if fields is None:
        return None
    h = hashlib.blake2b(digest_size=12)
    fed = False
    for name in fields:
        value = body.get(name)
        if not value:
            continue
        if name == "tools" and isinstance(value, list):
            data = _opening_bytes(value)
        elif name in ("system", "instructions"):
            data = _system_text(value)[:PART_BYTES].encode()
        else:
            data = b""
            _feed(h, _opening(value), PART_BYTES)
        h.update(data + b"\x00")
        fed = True
    return h.hexdigest() if fed else None


class Ring:
    """Consistent hashing of keys onto backends, with VNODES × weight points per backend."""

    def __init__(self, backends: Sequence[Backend]) -> None:
        points = sorted(
            (_hash64(f"{b.url}|{b.model}|{i}"), index)
            for index, b in enumerate(backends)
            for i in range(VNODES * b.weight)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [index for _, index in points]
        self.backends = list(backends)

    def walk(self, key: str) -> Iterator[Backend]:
        """Every backend once, in ring order from the key's place."""
        n, total = len(self.backends), len(self._owners)
        if not total:
            return
        seen: set[int] = set()
        start = bisect.bisect(self._hashes, _hash64(key))
        for step in range(total):
            owner = self._owners[(start + step) % total]
            if owner not in seen:
                seen.add(owner)
                yield self.backends[owner]
                if len(seen) == n:
                    return


def _named(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _opening(conversation: Any) -> Any:
    """The turns up to and including the first user message; a completions prompt (the first of a batch)."""
    if not isinstance(conversation, list):
        return conversation
    if conversation and not isinstance(conversation[0], dict):  # completions: token ids, or a batch
        return conversation if isinstance(conversation[0], int) else conversation[0]
    for i, item in enumerate(conversation):
        if isinstance(item, dict) and item.get("role") == "user":
            return conversation[: i + 1]
    return conversation


def _system_text(system: Any) -> str:
    """System text (a string or text blocks) without Claude Code's billing header."""
    if isinstance(system, list):
        texts = (b.get("text") for b in system if isinstance(b, dict))
        return "\x1f".join(t for t in texts if isinstance(t, str) and not t.startswith(BILLING_PREFIX))
    if isinstance(system, str) and not system.startswith(BILLING_PREFIX):
        return system
    return ""


def _opening_bytes(items: list[Any]) -> bytes:
    """The first PART_BYTES of a list's JSON, one item at a time (tools are small; their list may not be)."""
    out = b""
    for item in items:
        out += orjson.dumps(item)
        if len(out) >= PART_BYTES:
            break
    return out[:PART_BYTES]


def _feed(h: Any, value: Any, budget: int) -> int:
    """Hash at most `budget` bytes of value's content; the budget left."""
    if budget <= 0:
        return 0
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "cache_control" and budget > 0:
                h.update(b"\x1f" + k.encode()[:64] + b"\x1e")
                budget = _feed(h, v, budget - 1)
        return budget
    if isinstance(value, list):
        for item in value:
            if budget > 0:
                h.update(b"\x1f")
                budget = _feed(h, item, budget - 1)
        return budget
    data = (value if isinstance(value, str) else repr(value))[:budget].encode()[:budget]
    h.update(data)
    return budget - len(data)

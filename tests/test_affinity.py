"""The routing key of a request (kiln.affinity): pure functions of what the client sent.

The bodies are shaped like what Codex and Claude Code send (protocols.md §4.6,
real-clients.md); routing by these keys is tested end to end in test_router.py.
"""

from __future__ import annotations

import json
from collections import Counter

from kiln.affinity import Ring, affinity_key, claude_code_session, prompt_digest
from kiln.catalog import Backend

SESSION = "7f1c7a0e-58a4-4b8e-9d51-2f7d3c0b6a11"
TOOLS = [{"name": "Bash", "description": "Run a command", "input_schema": {"type": "object"}}]


def claude_code_body(turns: list[dict], user_id: str | None = None, nonce: str = "a1b2c") -> dict:
    body = {
        "model": "claude-sonnet-4-5",
        "system": [
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.90; cc_entrypoint=cli; cch={nonce};"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": TOOLS,
        "messages": turns,
        "max_tokens": 32000,
    }
    if user_id is not None:
        body["metadata"] = {"user_id": user_id}
    return body


def test_codex_prompt_cache_key_comes_first() -> None:
    body = {"model": "gpt-5", "input": "hi", "prompt_cache_key": SESSION, "user": "someone"}
    assert affinity_key(body, "responses", {}) == "cache:" + SESSION
    assert affinity_key({**body, "prompt_cache_key": ""}, "responses", {}) == "user:someone"


def test_claude_code_session_in_both_user_id_forms_and_the_header() -> None:
    new = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": SESSION})
    old = f"user_{'ab' * 32}_account_1d2e3f40-0000-4000-8000-000000000000_session_{SESSION}"
    turns = [{"role": "user", "content": "fix the bug"}]
    assert claude_code_session(new) == SESSION and claude_code_session(old) == SESSION
    assert affinity_key(claude_code_body(turns, new), "messages", {}) == "session:" + SESSION
    assert affinity_key(claude_code_body(turns, old), "messages", {}) == "session:" + SESSION
    headers = {"x-claude-code-session-id": SESSION}
    assert affinity_key(claude_code_body(turns), "messages", headers) == "session:" + SESSION
    # Another Anthropic client's user_id names a user, not a session.
    assert affinity_key(claude_code_body(turns, "alice"), "messages", {}) == "user:alice"


def test_openai_user_and_safety_identifier() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert affinity_key({**body, "safety_identifier": "u-1", "user": "u-2"}, "chat.completions", {}) == "user:u-1"
    assert affinity_key({**body, "user": "u-2"}, "chat.completions", {}) == "user:u-2"


def test_prompt_digest_stays_the_same_while_the_conversation_grows() -> None:
    marked = {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}
    turn1 = [{"role": "user", "content": [marked]}]
    turn2 = [
        {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},  # cache_control moved on
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": [{"type": "text", "text": "thanks", "cache_control": {"type": "ephemeral"}}]},
    ]
    first = affinity_key(claude_code_body(turn1, nonce="11111"), "messages", {})
    second = affinity_key(claude_code_body(turn2, nonce="22222"), "messages", {})  # new billing nonce too
    assert first is not None and first.startswith("prefix:")
    assert first == second
    other = affinity_key(claude_code_body([{"role": "user", "content": "write docs"}]), "messages", {})
    assert other != first


def test_prompt_digest_per_endpoint() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    grown = {"messages": [*chat["messages"], {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]}
    assert prompt_digest(chat, "chat.completions") == prompt_digest(grown, "chat.completions")
    responses = {"instructions": "I", "input": [{"role": "user", "content": "Q"}]}
    assert prompt_digest(responses, "responses") != prompt_digest({**responses, "instructions": "J"}, "responses")
    batch = prompt_digest({"prompt": ["Once upon", "x"]}, "completions")
    assert prompt_digest({"prompt": "Once upon"}, "completions") == batch
    assert prompt_digest({"model": "m"}, "chat.completions") is None


def test_prompt_digest_reads_a_bounded_opening() -> None:
    huge = "x" * 5_000_000
    a = prompt_digest({"messages": [{"role": "user", "content": huge + "a"}]}, "chat.completions")
    b = prompt_digest({"messages": [{"role": "user", "content": huge + "b"}]}, "chat.completions")
    assert a == b  # only the first few kilobytes count


def test_ring_spreads_keys_by_weight_and_moves_few_when_a_backend_leaves() -> None:
    backends = [Backend(f"http://10.0.0.{i}:8000/v1", "m", weight=3 if i == 0 else 1) for i in range(4)]
    ring = Ring(backends)
    owners = {f"session-{k}": next(ring.walk(f"session-{k}")) for k in range(6000)}
    share = Counter(b.url for b in owners.values())
    assert 0.4 < share[backends[0].url] / 6000 < 0.6  # weight 3 of 6
    for b in backends[1:]:
        assert 0.1 < share[b.url] / 6000 < 0.24
    walked = list(ring.walk("session-1"))
    assert sorted(b.url for b in walked) == sorted(b.url for b in backends)  # every backend once
    # Without backend 3, only its keys move.
    smaller = Ring(backends[:3])
    moved = sum(1 for key, owner in owners.items() if owner is not backends[3] and next(smaller.walk(key)) is not owner)
    assert moved == 0

"""Deterministic "generation": what the simulated model says for a request.

Output depends only on (--seed, rendered prompt) and the per-request ``sim``
control object, so tests and benchmarks can predict it and compare runs.
The result is a :class:`Plan` of token pieces; the server turns it into
either one JSON body or an SSE stream.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from . import tokenizer

VOCAB: tuple[str, ...] = tuple(
    """time year people way day thing world life hand part child eye place work week case
    point number group problem fact water room mother area money story month book job word
    issue side kind head house service friend father power hour game line end member city
    name team minute idea body information back parent face level office door health art
    history party result change morning reason research moment air teacher force education
    river stone garden window paper music light road table bread apple forest ocean cloud
    winter summer letter bridge market street field island mountain station village animal
    bird flower engine signal circle answer question pattern energy planet candle coffee
    language picture voice dream silver golden quiet simple bright gentle steady careful
    """.split()
)
_SPACED: tuple[str, ...] = tuple(" " + w for w in VOCAB)
_CAPITAL: tuple[str, ...] = tuple(w.capitalize() for w in VOCAB)


@dataclass(slots=True)
class ToolCall:
    """One emitted tool call; ``arguments`` is the JSON text sent on the wire."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class Plan:
    """The full output of one choice, decided before anything is sent."""

    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_reason: str | None = None
    completion_tokens: int = 0
    reasoning_tokens: int = 0


def rng_for(seed: int, key: str) -> random.Random:
    """PRNG seeded from the global seed and a prompt-derived key."""
    return random.Random((seed * 0x9E3779B1) ^ zlib.crc32(key.encode()))


@lru_cache(maxsize=4096)
def default_words(seed: int, key: str, n: int) -> tuple[str, ...]:
    """``n`` token pieces: a capitalised word, spaced words, then ``"."``.

    Cached because benchmarks repeat prompts; each piece is exactly one token.
    """
    if n <= 0:
        return ()
    idx = rng_for(seed, key).choices(range(len(VOCAB)), k=n)
    if n == 1:
        return (_CAPITAL[idx[0]],)
    return (_CAPITAL[idx[0]], *(_SPACED[i] for i in idx[1 : n - 1]), ".")


def word_for(name: str) -> str:
    """A stable plain word for a schema property name."""
    return VOCAB[zlib.crc32(name.encode()) % len(VOCAB)]


def value_for(schema: Any, name: str) -> Any:
    """A plausible value for one JSON-schema node (strings -> word, numbers -> 1...)."""
    if not isinstance(schema, dict):
        return word_for(name)
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            for opt in options:
                if isinstance(opt, dict) and opt.get("type") != "null":
                    return value_for(opt, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind in ("integer", "number"):
        return 1
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    if kind == "array":
        items = schema.get("items")
        return [value_for(items, name)] if isinstance(items, dict) else []
    if kind == "object" or "properties" in schema:
        return arguments_for(schema)
    return word_for(name)


def arguments_for(schema: Any) -> dict[str, Any]:
    """Arguments object for a function's ``parameters`` schema (all listed properties)."""
    if not isinstance(schema, dict):
        return {}
    props = schema.get("properties")
    out: dict[str, Any] = {}
    if isinstance(props, dict):
        for name, sub in props.items():
            out[name] = value_for(sub, name)
    required = schema.get("required")
    if isinstance(required, list):
        for name in required:
            if isinstance(name, str) and name not in out:
                out[name] = word_for(name)
    return out


def new_tool_call_id() -> str:
    """vLLM-style tool call id."""
    return "chatcmpl-tool-" + os.urandom(16).hex()


def make_tool_call(name: str, arguments: Any) -> ToolCall:
    """Build a call; object arguments are serialised like vLLM's hermes parser."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_tool_call_id(), name, arguments)


def tool_calls_text(calls: list[ToolCall]) -> str:
    """The raw text the model "generated" for these calls (for token counting)."""
    return "\n".join(
        "<tool_call>\n" + tokenizer.tool_call_json(c.name, c.arguments) + "\n</tool_call>" for c in calls
    )


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in text -> (index, stop)."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def cut_at(pieces: list[str], cut: int, end: int) -> tuple[list[str], int]:
    """Keep the text before char ``cut``; count tokens generated up to char ``end``.

    Returns the trimmed pieces and the number of tokens the model produced (the
    token that completed the stop string still counts, like vLLM).
    """
    kept: list[str] = []
    pos = 0
    produced = 0
    for p in pieces:
        if pos < end:
            produced += 1
        if pos < cut:
            take = p if pos + len(p) <= cut else p[: cut - pos]
            if take:
                kept.append(take)
        pos += len(p)
        if pos >= end and pos >= cut:
            break
    return kept, produced


def normalize_stop(stop: Any) -> list[str]:
    """``stop`` as str / list / null -> list of strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str)]
    return []


def finish_text(
    plan: Plan, pieces: list[str], budget: int, stops: list[str], include_stop: bool
) -> None:
    """Fill plan.content with ``pieces`` limited by ``budget`` tokens and stop strings."""
    truncated = len(pieces) > budget
    if truncated:
        pieces = pieces[:budget]
    hit = find_stop("".join(pieces), stops) if stops else None
    if hit is not None:
        idx, s = hit
        end = idx + len(s)
        plan.content, produced = cut_at(pieces, end if include_stop else idx, end)
        plan.completion_tokens += produced
        plan.finish_reason, plan.stop_reason = "stop", s
        return
    plan.content = list(pieces)
    plan.completion_tokens += len(pieces)
    plan.finish_reason = "length" if truncated else "stop"


def plan_chat(
    *,
    seed: int,
    prompt: str,
    reply_tokens: int,
    max_tokens: int,
    sim: dict[str, Any],
    reasoning_enabled: bool,
    calls: list[ToolCall],
    named_choice: bool,
    stops: list[str],
    include_stop: bool,
) -> Plan:
    """Decide reasoning, content or tool calls, finish_reason and token counts."""
    plan = Plan()
    budget = max_tokens
    reasoning: list[str] = []
    if isinstance(sim.get("reasoning"), str):
        reasoning = tokenizer.split(sim["reasoning"])
    elif reasoning_enabled:
        reasoning = list(default_words(seed, "\x00reasoning" + prompt, max(4, reply_tokens // 2)))
    if reasoning:
        if len(reasoning) > budget:
            reasoning = reasoning[:budget]
        plan.reasoning = reasoning
        plan.reasoning_tokens = plan.completion_tokens = len(reasoning)
        budget -= len(reasoning)
        if budget <= 0:
            plan.finish_reason = "length"
            return plan
    if calls:
        text = tool_calls_text(calls)
        pieces = tokenizer.split(text)
        if len(pieces) > budget:  # cut mid-call: the parser gives up, raw text is content
            plan.content = pieces[:budget]
            plan.completion_tokens += budget
            plan.finish_reason = "length"
            return plan
        plan.tool_calls = calls
        plan.completion_tokens += len(pieces)
        plan.finish_reason = "stop" if named_choice else "tool_calls"
        return plan
    finish_text(plan, reply_pieces(seed, prompt, reply_tokens, sim), budget, stops, include_stop)
    return plan


def plan_completion(
    *,
    seed: int,
    prompt: str,
    reply_tokens: int,
    max_tokens: int,
    sim: dict[str, Any],
    stops: list[str],
    include_stop: bool,
) -> Plan:
    """Plan for /v1/completions: plain text only."""
    plan = Plan()
    finish_text(plan, reply_pieces(seed, prompt, reply_tokens, sim), max_tokens, stops, include_stop)
    return plan


def reply_pieces(seed: int, prompt: str, reply_tokens: int, sim: dict[str, Any]) -> list[str]:
    """The reply's tokens: `sim.reply` tokenized, else `sim.reply_tokens` (or the default) words."""
    reply = sim.get("reply")
    if isinstance(reply, str):
        return tokenizer.split(reply)
    n = sim.get("reply_tokens")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else reply_tokens
    return list(default_words(seed, prompt, n))


def completion_logprobs(pieces: list[str], top: int, offset: int) -> dict[str, Any]:
    """A plausible legacy-completions logprobs object for the given pieces."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = offset
    for p in pieces:
        lp = -round((zlib.crc32(p.encode()) % 1000) / 1000.0, 4)
        tokens.append(p)
        lps.append(lp)
        offsets.append(pos)
        pos += len(p)
        alts = {p: lp}
        for k in range(1, top):
            alts[_SPACED[(zlib.crc32(p.encode()) + k) % len(_SPACED)]] = round(lp - k * 0.75, 4)
        tops.append(alts)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}

"""Usage.from_openai trusts a backend's counts only within bounds, on its fast path as on the general one."""

from __future__ import annotations

import itertools
from typing import Any

from kiln.core.records import MAX_TOKENS, Usage


def reference(u: Any) -> Usage | None:
    """The rule, spelled out: every count absent or an int in [0, MAX_TOKENS); cached and
    reasoning no larger than the prompt and the completion."""
    if not isinstance(u, dict):
        return None
    details, out = u.get("prompt_tokens_details"), u.get("completion_tokens_details")
    if (details and not isinstance(details, dict)) or (out and not isinstance(out, dict)):
        return None
    counts = [u.get("prompt_tokens"), u.get("completion_tokens"), (details or {}).get("cached_tokens"),
              (out or {}).get("reasoning_tokens", u.get("reasoning_tokens"))]
    if not all(c is None or (type(c) is int and 0 <= c < MAX_TOKENS) for c in counts):
        return None
    prompt, completion, cached, reasoning = (c or 0 for c in counts)
    return Usage(prompt, min(cached, prompt), completion, min(reasoning, completion), exact=True)


def test_every_shape_of_counts_is_bounded_alike() -> None:
    values = [0, 1, 17, MAX_TOKENS - 1, MAX_TOKENS, -1, None, True, 1.0, "3"]
    checked = 0
    for prompt, completion in itertools.product(values, repeat=2):
        for extra in ({"total_tokens": 5}, {"total_tokens": 5, "reasoning_tokens": 3}, {},
                      {"total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}},
                      {"total_tokens": 5, "prompt_tokens_details": None}, {"foo": 1}):
            u = {"prompt_tokens": prompt, "completion_tokens": completion, **extra}
            assert Usage.from_openai(u) == reference(u), u
            checked += 1
    assert checked == len(values) ** 2 * 6
    assert Usage.from_openai({"prompt_tokens": 17, "total_tokens": 37, "completion_tokens": 20}) == \
        Usage(17, 0, 20, 0, exact=True)
    assert Usage.from_openai([1, 2, 3]) is None and Usage.from_openai(None) is None

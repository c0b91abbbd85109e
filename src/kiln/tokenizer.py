"""Counting a prompt with the backend's own tokenizer.

Used by POST /v1/messages/count_tokens, and to bill a stream that ended
before the backend reported its usage (a client that left, a cut stream).
vLLM and SGLang count a chat prompt through the model's chat template at
`POST /tokenize` (root path, not /v1) in the messages form; a completions
prompt in the prompt form. When no backend can count, the caller falls back
to `estimate()` and says so in its log.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from kiln.catalog import Backend
from kiln.core.errors import GatewayError
from kiln.upstream import Upstream

log = logging.getLogger("kiln.tokenizer")
BYTES_PER_TOKEN = 4  # English and JSON on common tokenizers: about 3.5-4


async def count(upstream: Upstream, backends: list[Backend], payload: dict[str, Any],
                timeout_s: float = 10.0) -> int | None:
    """The first backend tokenizer's count of `payload`'s prompt; None if none could count it."""
    for backend in backends:
        url = backend.url.removesuffix("/v1") + "/tokenize"
        try:
            result = await upstream.post_json(backend, url, {**payload, "model": backend.model}, timeout_s)
        except GatewayError as exc:
            log.info("backend %s could not tokenize: %s", backend.url, exc.message)
            continue
        value = result.get("count") if isinstance(result, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def estimate(payload: dict[str, Any]) -> int:
    """A rough prompt size from its JSON: about four bytes per token."""
    text = payload.get("messages") or payload.get("prompt") or ""
    return max(len(orjson.dumps(text)) // BYTES_PER_TOKEN, 1)

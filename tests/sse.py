"""A recorded OpenAI-style SSE response (chat completions), for byte-level assertions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx


@dataclass
class SSE:
    status: int
    headers: httpx.Headers
    raw: str

    @property
    def frames(self) -> list[str]:
        """The events of the stream: the text between blank lines."""
        return [f for f in self.raw.split("\n\n") if f]

    @property
    def data(self) -> list[Any]:
        """Every data payload in order: parsed JSON (exact decimals), or the string "[DONE]".

        Any other frame must be an SSE comment (a keepalive)."""
        out = []
        for frame in self.frames:
            if frame.startswith("data: "):
                payload = frame[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload, parse_float=Decimal))
            else:
                assert frame.startswith(":"), frame
        return out

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [d for d in self.data if isinstance(d, dict)]

    def content(self) -> str:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in self.chunks if c.get("choices"))

    def reasoning(self) -> str:
        return "".join(c["choices"][0]["delta"].get("reasoning") or "" for c in self.chunks if c.get("choices"))

    def finish_reasons(self) -> list[str]:
        return [c["choices"][0]["finish_reason"] for c in self.chunks
                if c.get("choices") and c["choices"][0].get("finish_reason")]

"""The domain's records: organisations, projects, keys and usage events.

Plain dataclasses shared by the store, the in-memory caches and the admin
API. Amounts are integer nanodollars (see money.py); times are Unix seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kiln.core.money import nano_to_usd_str

KEY_STATUSES = ("active", "suspended", "revoked")
SPEND_RESETS = ("never", "daily", "weekly", "monthly")


@dataclass(slots=True)
class Org:
    id: str
    name: str
    credits_nano: int = 0
    monthly_budget_nano: int | None = None
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    concurrency_limit: int | None = None
    created_at: float = 0.0
    # Derived, kept in memory: spend in the current calendar month (UTC).
    month_spend_nano: int = 0
    month: str = ""

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "credits": nano_to_usd_str(self.credits_nano),
            "monthly_budget": _usd_or_none(self.monthly_budget_nano),
            "month_spend": nano_to_usd_str(self.month_spend_nano),
            "rpm_limit": self.rpm_limit,
            "tpm_limit": self.tpm_limit,
            "concurrency_limit": self.concurrency_limit,
            "created_at": int(self.created_at),
        }


@dataclass(slots=True)
class Project:
    id: str
    org_id: str
    name: str
    created_at: float = 0.0

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["created_at"] = int(self.created_at)
        return d


@dataclass(slots=True)
class ApiKey:
    id: str
    project_id: str
    org_id: str
    key_hash: str
    prefix: str
    name: str = ""
    status: str = "active"
    spend_limit_nano: int | None = None
    expires_at: float | None = None
    spend_nano: int = 0
    created_at: float = 0.0
    spend_reset: str = "never"  # never | daily | weekly | monthly: when the spend limit starts again
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    concurrency_limit: int | None = None
    # Derived, kept in memory: spend in the current reset period (all spend when "never").
    period_spend_nano: int = 0
    period: str = ""

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "project_id": self.project_id,
            "org_id": self.org_id,
            "name": self.name,
            "prefix": self.prefix,
            "status": self.status,
            "spend_limit": _usd_or_none(self.spend_limit_nano),
            "spend_reset": self.spend_reset,
            "period_spend": nano_to_usd_str(self.period_spend_nano),
            "expires_at": int(self.expires_at) if self.expires_at is not None else None,
            "spend": nano_to_usd_str(self.spend_nano),
            "rpm_limit": self.rpm_limit,
            "tpm_limit": self.tpm_limit,
            "concurrency_limit": self.concurrency_limit,
            "created_at": int(self.created_at),
        }


@dataclass(slots=True)
class UsageEvent:
    """One metered request; its id is the X-Neocloud-Generation-Id."""

    id: str
    created_at: float
    org_id: str
    project_id: str
    key_id: str
    model: str
    endpoint: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cost_nano: int = 0
    status: str = "ok"
    cancelled: bool = False
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    streamed: bool = False
    finish_reason: str | None = None  # the first output's, as the client saw it (stop, length, ...)
    backend: str | None = None  # the URL of the model server that served it; operators only

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"] = nano_to_usd_str(d.pop("cost_nano"))
        return d


def _usd_or_none(nano: int | None) -> str | None:
    return None if nano is None else nano_to_usd_str(nano)


@dataclass(slots=True)
class Usage:
    """Token counts of one request, in OpenAI's sense: prompt includes cached."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    exact: bool = False  # False: estimated (the backend never reported usage)

    @classmethod
    def from_openai(cls, u: Any) -> "Usage | None":
        """A backend's usage object, or None when it is not one Kiln can trust: every count
        must be a non-negative integer no larger than MAX_TOKENS (the caller then bounds it
        by the request's own limits and falls back to its estimate)."""
        if not isinstance(u, dict):
            return None
        # Straight-line checks, no generator: a continuous-usage stream brings one per token.
        prompt, completion = u.get("prompt_tokens"), u.get("completion_tokens")
        if (len(u) == 3 and type(prompt) is int and type(completion) is int and "total_tokens" in u
                and 0 <= prompt < MAX_TOKENS and 0 <= completion < MAX_TOKENS):
            return cls(prompt, 0, completion, 0, True)  # the three counts alone: nothing cached, no reasoning
        cached, reasoning = None, u.get("reasoning_tokens")
        details, out_details = u.get("prompt_tokens_details"), u.get("completion_tokens_details")
        if details:
            if not isinstance(details, dict):
                return None
            cached = details.get("cached_tokens")
        if out_details:
            if not isinstance(out_details, dict):
                return None
            reasoning = out_details.get("reasoning_tokens", reasoning)
        if not (_count_ok(prompt) and _count_ok(completion) and _count_ok(cached) and _count_ok(reasoning)):
            return None
        prompt, completion, cached, reasoning = prompt or 0, completion or 0, cached or 0, reasoning or 0
        return cls(prompt, min(cached, prompt), completion, min(reasoning, completion), exact=True)


MAX_TOKENS = 1 << 31  # no request has more tokens than this; larger counts are garbage


def _count_ok(value: Any) -> bool:
    """Absent, or a non-negative int below MAX_TOKENS (orjson makes no int subclass but bool)."""
    return value is None or (type(value) is int and 0 <= value < MAX_TOKENS)

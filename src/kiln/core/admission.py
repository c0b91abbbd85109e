"""Admission: may this request start now?

Checked after authentication and parsing, before any upstream call, with
the first failing reason returned: credits, monthly budget and key spend
limit (402), requests and tokens per minute (429 with rate-limit headers)
and requests in flight (429 without headers, per the contract). Tokens
count when a request ends, so the tokens-per-minute check admits on what
the last minute actually used. In-process state; the
interface (admit -> Ticket, release) is what a Redis-backed implementation
for several replicas provides as well.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kiln.config import Limits
from kiln.core import errors
from kiln.core.accounts import month_of
from kiln.core.records import ApiKey, Org


@dataclass(slots=True)
class Ticket:
    org_id: str
    released: bool = False


@dataclass(slots=True)
class _Window:
    """Amounts recorded in the last minute, with their running sum."""

    entries: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def used(self, now: float) -> int:
        entries = self.entries
        while entries and entries[0][0] <= now - 60.0:
            self.total -= entries.popleft()[1]
        return self.total

    def add(self, now: float, amount: int) -> None:
        self.entries.append((now, amount))
        self.total += amount

    def reset_in(self, now: float) -> int:
        """Seconds until the oldest entry leaves the window."""
        return max(1, int(self.entries[0][0] + 60.0 - now + 0.999)) if self.entries else 1


@dataclass(slots=True)
class _OrgState:
    in_flight: int = 0
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)


class Admission:
    def __init__(self, defaults: Limits) -> None:
        self.defaults = defaults
        self._state: dict[str, _OrgState] = {}

    def admit(self, key: ApiKey, org: Org) -> Ticket:
        if org.credits_nano <= 0:
            raise errors.payment_required("Your organisation's credits are exhausted. Top up to continue.",
                                          "credits_exhausted")
        month = month_of(time.time())
        if org.month != month:  # a new calendar month: the budget starts again
            org.month, org.month_spend_nano = month, 0
        if org.monthly_budget_nano is not None and org.month_spend_nano >= org.monthly_budget_nano:
            raise errors.payment_required("Your organisation reached its monthly budget.", "budget_exceeded")
        if key.spend_limit_nano is not None and key.spend_nano >= key.spend_limit_nano:
            raise errors.payment_required("This API key reached its spend limit.", "key_spend_limit_reached")
        state = self._state.setdefault(org.id, _OrgState())
        concurrency = org.concurrency_limit or self.defaults.concurrency
        if state.in_flight >= concurrency:
            raise errors.rate_limited(
                f"Your organisation already has {concurrency} requests in flight. Back off and retry."
            )
        now = time.monotonic()
        rpm = org.rpm_limit or self.defaults.rpm
        if state.requests.used(now) >= rpm:
            reset = state.requests.reset_in(now)
            raise errors.rate_limited(
                f"Rate limit of {rpm} requests per minute reached. Retry in {reset} s.",
                headers=_headers("requests", rpm, reset),
            )
        tpm = org.tpm_limit or self.defaults.tpm
        if tpm is not None and state.tokens.used(now) >= tpm:
            reset = state.tokens.reset_in(now)
            raise errors.rate_limited(
                f"Rate limit of {tpm} tokens per minute reached. Retry in {reset} s.",
                headers=_headers("tokens", tpm, reset),
            )
        state.requests.add(now, 1)
        state.in_flight += 1
        return Ticket(org.id)

    def release(self, ticket: Ticket, tokens: int = 0) -> None:
        """End of a request: free its slot and count the tokens it used."""
        if not ticket.released:
            ticket.released = True
            state = self._state[ticket.org_id]
            state.in_flight -= 1
            if tokens:
                state.tokens.add(time.monotonic(), tokens)

    def in_flight(self, org_id: str) -> int:
        state = self._state.get(org_id)
        return state.in_flight if state else 0


def _headers(kind: str, limit: int, reset: int) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": "0",
        "x-ratelimit-reset": str(reset),
        "retry-after": str(reset),
    }

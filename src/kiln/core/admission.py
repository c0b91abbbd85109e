"""Admission: may this request start now?

Checked after authentication and parsing, before any upstream call, with
the first failing reason returned: credits, monthly budget and key spend
limit (402), requests per minute (429 with rate-limit headers) and requests
in flight (429 without headers, per the contract). In-process state; the
interface (admit -> Ticket, release) is what a Redis-backed implementation
for several replicas provides as well.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kiln.config import Limits
from kiln.core import errors
from kiln.core.records import ApiKey, Org


@dataclass(slots=True)
class Ticket:
    org_id: str
    released: bool = False


@dataclass(slots=True)
class _OrgState:
    in_flight: int = 0
    starts: deque[float] = field(default_factory=deque)  # request start times in the last minute


class Admission:
    def __init__(self, defaults: Limits) -> None:
        self.defaults = defaults
        self._state: dict[str, _OrgState] = {}

    def admit(self, key: ApiKey, org: Org) -> Ticket:
        if org.credits_nano <= 0:
            raise errors.payment_required("Your organisation's credits are exhausted. Top up to continue.",
                                          "credits_exhausted")
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
        rpm = org.rpm_limit or self.defaults.rpm
        now = time.monotonic()
        starts = state.starts
        while starts and starts[0] <= now - 60.0:
            starts.popleft()
        if len(starts) >= rpm:
            reset = max(1, int(starts[0] + 60.0 - now + 0.999))
            raise errors.rate_limited(
                f"Rate limit of {rpm} requests per minute reached. Retry in {reset} s.",
                headers={
                    "x-ratelimit-limit-requests": str(rpm),
                    "x-ratelimit-remaining-requests": "0",
                    "x-ratelimit-reset": str(reset),
                    "retry-after": str(reset),
                },
            )
        starts.append(now)
        state.in_flight += 1
        return Ticket(org.id)

    def release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self._state[ticket.org_id].in_flight -= 1

    def in_flight(self, org_id: str) -> int:
        state = self._state.get(org_id)
        return state.in_flight if state else 0

"""Admission: may this request start now, and how much may it spend?

One step, after authentication and parsing and before any upstream call,
that checks and reserves everything together and answers with the first
failing reason: credits, monthly budget and key spend limit (402, each with
its own code), requests and tokens per minute and requests in flight, per
organisation and optionally per key (429).

Money is reserved, not just checked. A request reserves an upper bound on
its prompt's cost (one token per byte of the body: no tokenizer produces
more) plus a bounded output estimate, against credits, budget and key limit
at once. Streams start with at most OUTPUT_BLOCK tokens reserved and extend
the reservation as they go; when it cannot be extended the gateway ends the
generation cleanly with a "length" finish. A non-streaming request reserves
its whole output, capped to what the money left covers (its max_tokens is
lowered to match). Settling releases the reservation and charges the real
cost. A stream is cut at the chunk that uses up its reservation, and a cut
stream is billed for the chunks it delivered (about one token each on vLLM;
the prompt by the backend's tokenizer). So spend passes a limit only when a
chunk carries more than one token: the documented bound is the tokens of one
chunk per stream in flight (a handful at most, e.g. with speculative decoding).

This is the in-process implementation. RedisAdmission (admission_redis.py),
for several processes and replicas, provides the same four calls with the
same semantics and bound, as atomic scripts with leases that expire if a
replica dies.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Protocol

from kiln.config import Limits
from kiln.core import errors
from kiln.core.accounts import charge, roll_periods
from kiln.core.clock import CLOCK, Clock
from kiln.core.records import ApiKey, Org

OUTPUT_BLOCK = 512  # tokens a stream reserves at a time


@dataclass(slots=True)
class Demand:
    """What a request may cost and what it is, as admission needs to know it.

    `outputs` is how many completions the backend generates for it (prompts x n
    on legacy completions, n on chat): each may run to `max_output_tokens`.
    `kind` "count" is a count_tokens call: no money, no in-flight slot, its own
    per-minute window (it runs no inference).
    """

    prompt_tokens_max: int
    input_nano_per_token: Decimal
    output_nano_per_token: Decimal
    max_output_tokens: int  # per output
    stream: bool
    outputs: int = 1
    model: str = ""
    endpoint: str = ""
    kind: str = "generation"  # "generation" | "count"


@dataclass(slots=True)
class Ticket:
    org_id: str
    key_id: str
    generation_id: str = ""
    reserved_nano: int = 0
    output_tokens: int = 0  # output tokens the reservation covers, all outputs together
    output_nano_per_token: Decimal = Decimal(0)
    capped: bool = False  # a non-streaming request's max_tokens must be lowered (per output: output_tokens // outputs)
    outputs: int = 1
    kind: str = "generation"
    released: bool = False


SLICES_PER_S = 10  # a rate window's resolution: amounts within one tenth of a second share an entry
WINDOW_S = 60


@dataclass(slots=True)
class _Slice:
    """The amounts of one tenth of a second, and when the latest of them came."""

    number: int  # floor(time * SLICES_PER_S)
    amount: int
    latest: float


@dataclass(slots=True)
class _Window:
    """Amounts recorded in the last minute, with their running sum.

    Kept per tenth of a second: a window holds at most 600 slices however many requests a
    second it counts (one entry per request would hold a minute of traffic: 40 MiB at 1,500
    requests a second). A slice leaves the window a minute after its latest amount: its
    earlier amounts stay at most 0.1 s longer than a minute, never less, so a limit is never
    passed, and the reset a refusal announces is when its oldest slice leaves (at most 60 s,
    like an exact window's)."""

    slices: deque[_Slice] = field(default_factory=deque)
    total: int = 0

    def used(self, now: float) -> int:
        slices = self.slices
        cutoff = now - WINDOW_S
        while slices and slices[0].latest <= cutoff:
            self.total -= slices.popleft().amount
        return self.total

    def add(self, now: float, amount: int) -> None:
        number = math.floor(now * SLICES_PER_S)
        slices = self.slices
        if slices and slices[-1].number == number:
            last = slices[-1]
            last.amount += amount
            last.latest = now
        else:  # a new slice: what left the window goes (a window no limit reads stays bounded too)
            self.used(now)
            slices.append(_Slice(number, amount, now))
        self.total += amount

    def reset_in(self, now: float) -> int:
        """Whole seconds until the oldest slice leaves the window."""
        return max(1, math.ceil(self.slices[0].latest + WINDOW_S - now)) if self.slices else 0


@dataclass(slots=True)
class _State:
    """Per organisation, and per key for keys with their own limits."""

    in_flight: int = 0
    reserved_nano: int = 0
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)
    counts: _Window = field(default_factory=_Window)  # count_tokens calls


class AdmissionControl(Protocol):
    """What the pipeline needs; MemoryAdmission here, RedisAdmission for several processes.

    Every call is a coroutine so a distributed implementation can make each one
    a single atomic round trip; the in-process one never awaits inside, so each
    call is atomic there too.
    """

    async def admit(self, key: ApiKey, org: Org, demand: Demand, generation_id: str = "") -> Ticket:
        """Check and reserve everything together, or raise the first failing reason (402/429)."""

    async def extend(self, ticket: Ticket, key: ApiKey, org: Org, tokens: int = OUTPUT_BLOCK,
                     delivered_nano: int = 0) -> int:
        """Reserve up to `tokens` more output for a running stream; returns how many.

        `delivered_nano` is what the stream has cost so far (what to bill if the
        process serving it dies before it ends)."""

    async def settle(self, ticket: Ticket, key: ApiKey, org: Org, cost_nano: int = 0, tokens: int = 0) -> None:
        """End of a request: charge its real cost, release its reservation and slot, count its
        tokens, all in one step; idempotent."""

    async def state(self, key: ApiKey | None, org: Org) -> dict[str, object]:
        """What the key (or, without one, the organisation) can still spend and its rate-limit
        state (GET /v1/key, admin)."""


class MemoryAdmission:
    """In-process admission: exact for one gateway process."""

    def __init__(self, defaults: Limits, clock: Clock = CLOCK) -> None:
        self.defaults = defaults
        self.clock = clock
        self._orgs: dict[str, _State] = {}
        self._keys: dict[str, _State] = {}

    # -- the four calls -------------------------------------------------------

    async def admit(self, key: ApiKey, org: Org, demand: Demand, generation_id: str = "") -> Ticket:
        roll_periods(org, key, self.clock.time())
        # get, then setdefault only for a newcomer: setdefault's argument would build a state
        # (three windows, three deques) on every request, to be thrown away
        org_state = self._orgs.get(org.id) or self._orgs.setdefault(org.id, _State())
        key_state = self._keys.get(key.id) or self._keys.setdefault(key.id, _State())
        now = self.clock.monotonic()
        if demand.kind == "count":
            _check_counts(org_state, self.defaults.count_tokens_rpm, now)
            org_state.counts.add(now, 1)
            return Ticket(org.id, key.id, generation_id, kind="count", released=True)
        available, scope = self._available(key, org, org_state, key_state)
        prompt_nano = _ceil(demand.prompt_tokens_max * demand.input_nano_per_token)
        if available <= prompt_nano:
            raise payment_error(scope, available <= 0)
        self._check_rates(org_state, org.concurrency_limit or self.defaults.concurrency,
                          org.rpm_limit or self.defaults.rpm, org.tpm_limit or self.defaults.tpm, now, "organisation")
        self._check_rates(key_state, key.concurrency_limit, key.rpm_limit, key.tpm_limit, now, "key")
        ticket = _ticket(org, key, demand, generation_id, available - prompt_nano, scope)
        self._reserve(ticket, prompt_nano + _ceil(ticket.output_tokens * demand.output_nano_per_token))
        for state in (org_state, key_state):
            state.in_flight += 1
            state.requests.add(now, 1)
        return ticket

    async def extend(self, ticket: Ticket, key: ApiKey, org: Org, tokens: int = OUTPUT_BLOCK,
                     delivered_nano: int = 0) -> int:
        """Reserve up to `tokens` more output tokens for a running stream; returns how many.

        In one process a stream cannot outlive its gateway, so `delivered_nano`
        needs no record here."""
        if ticket.released:
            return 0
        available, _ = self._available(key, org, self._orgs[org.id], self._keys[key.id])
        granted = min(tokens, _affordable(available, ticket.output_nano_per_token))
        if granted > 0:
            self._reserve(ticket, _ceil(granted * ticket.output_nano_per_token))
            ticket.output_tokens += granted
        return granted

    async def settle(self, ticket: Ticket, key: ApiKey, org: Org, cost_nano: int = 0, tokens: int = 0) -> None:
        """Charge the real cost and release the reservation and slot, with no await in between,
        so no other request ever sees one without the other."""
        if ticket.released:
            return
        ticket.released = True
        charge(org, key, cost_nano, self.clock.time())
        now = self.clock.monotonic()
        for state in (self._orgs[ticket.org_id], self._keys[ticket.key_id]):
            state.in_flight -= 1
            state.reserved_nano -= ticket.reserved_nano
            if tokens:
                state.tokens.add(now, tokens)

    async def state(self, key: ApiKey | None, org: Org) -> dict[str, object]:
        """What the key (or the organisation) can still spend and its rate-limit state."""
        roll_periods(org, key, self.clock.time())
        org_state = self._orgs.get(org.id) or _State()
        key_state = (self._keys.get(key.id) if key is not None else None) or _State()
        available, scope = self._available(key, org, org_state, key_state)
        now = self.clock.monotonic()
        rpm = org.rpm_limit or self.defaults.rpm
        tpm = org.tpm_limit or self.defaults.tpm
        return {
            "spendable_nano": max(available, 0),
            "spendable_limited_by": scope,
            "requests_per_minute": rpm,
            "requests_left": max(rpm - org_state.requests.used(now), 0),
            "requests_reset_s": org_state.requests.reset_in(now),
            "tokens_per_minute": tpm,
            "tokens_left": None if tpm is None else max(tpm - org_state.tokens.used(now), 0),
            "tokens_reset_s": org_state.tokens.reset_in(now),
            "in_flight": org_state.in_flight,
            "concurrency_limit": org.concurrency_limit or self.defaults.concurrency,
        }

    # -- helpers ------------------------------------------------------------------

    def _available(self, key: ApiKey | None, org: Org, org_state: _State, key_state: _State) -> tuple[int, str]:
        """Money left after reservations, and which limit binds."""
        left = [(org.credits_nano - org_state.reserved_nano, "credits")]
        if org.monthly_budget_nano is not None:
            left.append((org.monthly_budget_nano - org.month_spend_nano - org_state.reserved_nano, "budget"))
        if key is not None and key.spend_limit_nano is not None:
            left.append((key.spend_limit_nano - key.period_spend_nano - key_state.reserved_nano, "key"))
        return min(left)

    def _reserve(self, ticket: Ticket, nano: int) -> None:
        ticket.reserved_nano += nano
        self._orgs[ticket.org_id].reserved_nano += nano
        self._keys[ticket.key_id].reserved_nano += nano

    @staticmethod
    def _check_rates(state: _State, concurrency: int | None, rpm: int | None, tpm: int | None,
                     now: float, who: str) -> None:
        if concurrency is not None and state.in_flight >= concurrency:
            raise concurrency_error(who, concurrency)
        if rpm is None and tpm is None:
            return
        requests, tokens = state.requests.used(now), state.tokens.used(now)
        if rpm is not None and requests >= rpm:
            raise rate_error(who, rpm, "requests", state.requests.reset_in(now),
                             rate_headers(rpm, tpm, requests, tokens))
        if tpm is not None and tokens >= tpm:
            raise rate_error(who, tpm, "tokens", state.tokens.reset_in(now), rate_headers(rpm, tpm, requests, tokens))


def concurrency_error(who: str, limit: int) -> errors.GatewayError:
    # The contract: the concurrency 429 carries no rate-limit headers.
    return errors.rate_limited(f"This {who} already has {limit} requests in flight. Back off and retry.",
                               reason="concurrency")


def rate_headers(rpm: int | None, tpm: int | None, requests_used: int, tokens_used: int) -> dict[str, str]:
    headers: dict[str, str] = {}
    if rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(rpm - requests_used, 0))
    if tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(tpm - tokens_used, 0))
    return headers


def rate_error(who: str, limit: int, what: str, reset: int, headers: dict[str, str]) -> errors.GatewayError:
    """A per-minute limit reached (`what`: "requests" or "tokens"), with when to retry."""
    return errors.rate_limited(
        f"This {who} reached its limit of {limit} {what} per minute. Retry in {reset} s.",
        headers={**headers, "x-ratelimit-reset": str(reset), "retry-after": str(reset)},
        reason=f"{what}_per_minute",
    )


def count_error(limit: int, reset: int) -> errors.GatewayError:
    return errors.rate_limited(
        f"This organisation reached its limit of {limit} token counts per minute. Retry in {reset} s.",
        headers={"x-ratelimit-reset": str(reset), "retry-after": str(reset)},
        reason="token_counts_per_minute",
    )


def _ceil(value: Decimal | int) -> int:
    return int(math.ceil(value))


def _affordable(nano: int, per_token: Decimal) -> int:
    if nano <= 0:
        return 0
    if per_token <= 0:
        return 1 << 40
    return int(nano // per_token)


def _ticket(org: Org, key: ApiKey, demand: Demand, generation_id: str, money_left: int, scope: str) -> Ticket:
    """The output a new request may reserve: one block per output for a stream, the whole
    output otherwise, lowered to what `money_left` covers (402 when not one token each)."""
    outputs = max(demand.outputs, 1)
    per_output = min(demand.max_output_tokens, OUTPUT_BLOCK) if demand.stream else demand.max_output_tokens
    want = per_output * outputs
    output = min(want, _affordable(money_left, demand.output_nano_per_token))
    if want >= 1 and output < outputs:
        raise payment_error(scope, False)
    if not demand.stream and output < want:
        output -= output % outputs  # an equal cap for every output
    return Ticket(org.id, key.id, generation_id, output_tokens=output,
                  output_nano_per_token=demand.output_nano_per_token,
                  capped=not demand.stream and output < want, outputs=outputs, kind=demand.kind)


def _check_counts(state: _State, limit: int, now: float) -> None:
    """count_tokens has its own window: it runs no inference, and Claude Code fires dozens at once."""
    if state.counts.used(now) >= limit:
        raise count_error(limit, state.counts.reset_in(now))


_PAYMENT = {
    "credits": ("credits_exhausted", "Your organisation's credits are exhausted. Top up to continue.",
                "Your organisation's remaining credits do not cover this request."),
    "budget": ("budget_exceeded", "Your organisation reached its monthly budget.",
               "Your organisation's remaining monthly budget does not cover this request."),
    "key": ("key_spend_limit_reached", "This API key reached its spend limit.",
            "This API key's remaining spend limit does not cover this request."),
}


def payment_error(scope: str, exhausted: bool) -> errors.GatewayError:
    code, gone, short = _PAYMENT[scope]
    return errors.payment_required(gone if exhausted else short, code,
                                   reason={"key": "key_spend_limit"}.get(scope, scope))

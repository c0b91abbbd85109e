"""Admission shared by every gateway process and replica, in Redis.

The same four calls, semantics and overspend bound as MemoryAdmission (see
admission.py), each one atomic Redis Function (admission_lua.py): admit checks
and reserves credits, monthly budget, key spend limit, rpm, tpm and the
in-flight slot together or not at all; extend and settle likewise. A short
request costs two round trips (admit, settle), a stream one more per 512-token
extension. Time is the Redis server's.

Redis is a cache that can be rebuilt; the database is the truth:
- credits in Redis are the last committed balance (with its version) minus the
  costs settled and not yet committed; the ledger reports each commit (the
  events and the new balances), the refresh poll and top-ups re-send balances,
  and an older balance never replaces a newer one;
- an organisation or key Redis does not know (first use, or Redis lost its
  data) is loaded from the database before anything is admitted: credits, the
  month's spend and the key's period spend. After a loss, new admissions wait
  a few seconds while every gateway re-registers the requests it still serves.
  What can escape: the cost of events settled but not yet committed when Redis
  lost its data (one group commit per process; longer if the database is down
  at the same time, the spool's case);
- in-flight slots are leases (LEASE_TTL_S) that one task per process renews
  in one call; a replica that dies stops renewing, its slots and reservations
  are freed when the lease expires, and a sweeper on any replica bills what its
  streams had delivered at their last extension, as usage events `lost`.

Fail closed: when Redis cannot be reached, admit raises a 503 with
Retry-After, extend grants nothing (the stream ends cleanly), and a settle is
retried until Redis takes it. It all recovers by itself once Redis answers.
One Redis primary (Sentinel or a managed failover are fine); not Redis Cluster:
a decision touches keys of an organisation, a key and the shared lease set.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Any

from kiln.config import Limits
from kiln.core import errors
from kiln.core.accounts import charge, month_start, period_start, roll_periods
from kiln.core.admission import (
    OUTPUT_BLOCK, Demand, Ticket, concurrency_error, count_error, payment_error, rate_error, rate_headers,
)
from kiln.core.admission_lua import LIBRARY
from kiln.core.clock import CLOCK, Clock
from kiln.core.records import ApiKey, Org, UsageEvent
from kiln.core.resp import RedisError, Resp
from kiln.store.base import CreditBalances, Store

log = logging.getLogger("kiln.admission")

LEASE_TTL_S = 10.0
RENEW_EVERY_S = 2.0
SWEEP_EVERY_S = 1.0
RETRY_AFTER_S = "2"
_UNREACHABLE = (ConnectionError, OSError, asyncio.TimeoutError)


@dataclass(slots=True)
class _Lease:
    """A request this process serves, as the renewer needs it (and to re-register it)."""

    ticket: Ticket
    key: ApiKey
    org: Org
    model: str
    endpoint: str
    epoch: str
    delivered_nano: int = 0
    settled: bool = False  # settle is waiting for Redis: renew the lease, never re-register it
    loaded: bool = False  # the renewer asked the database to load its organisation once


def _limit(value: int | None) -> int:
    return -1 if value is None else value


class RedisAdmission:
    def __init__(self, url: str, defaults: Limits, store: Store, prefix: str = "kiln", clock: Clock = CLOCK) -> None:
        self.clock = clock  # only its offset (the test clock): time itself comes from Redis
        self.redis = Resp(url)
        self.defaults = defaults
        self.store = store
        self.prefix = prefix
        self.ledger: Any = None  # kiln.core.ledger.Ledger, set by the wiring: lost streams are billed through it
        self.reachable = True
        self._live: dict[str, _Lease] = {}
        self._unsettled: dict[str, tuple[int, int]] = {}  # generation id -> (cost, tokens)
        self._seen = False  # this process admitted through this Redis state before
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loading: dict[tuple[str, str], asyncio.Future[None]] = {}

    async def start(self) -> None:
        try:
            await self._load_library()
        except _UNREACHABLE as exc:  # fail closed until it answers; the tasks keep trying
            self._down(exc)
        self._tasks = [asyncio.create_task(self._renew_forever(), name="kiln-lease-renewer"),
                       asyncio.create_task(self._sweep_forever(), name="kiln-lease-sweeper")]

    async def stop_tasks(self) -> None:
        """Stop renewing and sweeping (before the ledger stops: the sweeper bills through it)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def close(self) -> None:
        """Settle what waited for Redis, then disconnect (after the ledger stopped: it reports here)."""
        try:
            await self._retry_settles()
        except errors.GatewayError:
            log.error("%d settles never reached Redis; their leases expire and are billed as lost",
                      len(self._unsettled))
        await self.redis.close()

    # -- the four calls -------------------------------------------------------

    async def admit(self, key: ApiKey, org: Org, demand: Demand, generation_id: str = "") -> Ticket:
        gen = generation_id or f"cnt-{secrets.token_hex(12)}"
        d = self.defaults
        limits = (org.concurrency_limit or d.concurrency, org.rpm_limit or d.rpm, org.tpm_limit or d.tpm,
                  key.concurrency_limit, key.rpm_limit, key.tpm_limit)
        outputs = max(demand.outputs, 1)
        per_output = min(demand.max_output_tokens, OUTPUT_BLOCK) if demand.stream else demand.max_output_tokens
        price = demand.output_nano_per_token
        args = (self.clock.offset, org.id, key.id, gen, key.project_id, demand.model, demand.endpoint, demand.kind,
                *(_limit(x) for x in limits[:3]), _limit(org.monthly_budget_nano), *(_limit(x) for x in limits[3:]),
                _limit(key.spend_limit_nano), key.spend_reset,
                math.ceil(demand.prompt_tokens_max * demand.input_nano_per_token), repr(float(price)),
                per_output * outputs, outputs, int(demand.stream), d.count_tokens_rpm, LEASE_TTL_S)
        for _ in range(3):
            r = await self._call("kiln_v1_admit", *args)
            if r[0] != "load":
                break
            await self._load(org, key, float(r[1]))
        if r[0] != "ok":
            raise _refusal(r, limits, d.count_tokens_rpm)
        if demand.kind == "count":
            return Ticket(org.id, key.id, generation_id, kind="count", released=True)
        self._seen = True
        output, reserved, capped, epoch = int(r[1]), int(r[2]), r[3] == 1, r[4]
        ticket = Ticket(org.id, key.id, gen, reserved_nano=reserved, output_tokens=output,
                        output_nano_per_token=price, capped=capped, outputs=outputs, kind=demand.kind)
        self._live[gen] = _Lease(ticket, key, org, demand.model, demand.endpoint, epoch)
        return ticket

    async def extend(self, ticket: Ticket, key: ApiKey, org: Org, tokens: int = OUTPUT_BLOCK,
                     delivered_nano: int = 0) -> int:
        """Reserve more output and record what the stream has cost so far: what a sweeper bills
        if this process dies before the stream ends. Redis unreachable: nothing more."""
        if ticket.released:
            return 0
        lease = self._live.get(ticket.generation_id)
        if lease is not None:
            lease.delivered_nano = delivered_nano
        price = ticket.output_nano_per_token
        try:
            granted = int(await self._call(
                "kiln_v1_extend", self.clock.offset, ticket.generation_id, tokens, repr(float(price)), delivered_nano,
                _limit(org.monthly_budget_nano), _limit(key.spend_limit_nano), LEASE_TTL_S))
        except errors.GatewayError:
            return 0
        ticket.output_tokens += granted
        ticket.reserved_nano += math.ceil(granted * price)
        return granted

    async def settle(self, ticket: Ticket, key: ApiKey, org: Org, cost_nano: int = 0, tokens: int = 0) -> None:
        if ticket.released:
            return
        ticket.released = True
        # The local caches, for display: month and key spend now; credits as committed (Accounts.take_credits).
        now = self.clock.time()
        roll_periods(org, None, now)
        org.month_spend_nano += cost_nano
        charge(None, key, cost_nano, now)
        try:
            await self._call("kiln_v1_settle", self.clock.offset, ticket.generation_id, cost_nano, tokens)
        except errors.GatewayError:
            log.warning("settling %s waits for Redis", ticket.generation_id)
            self._unsettled[ticket.generation_id] = (cost_nano, tokens)
            if (lease := self._live.get(ticket.generation_id)) is not None:
                lease.settled = True
            return
        self._live.pop(ticket.generation_id, None)

    async def state(self, key: ApiKey | None, org: Org) -> dict[str, object]:
        d = self.defaults
        rpm, tpm = org.rpm_limit or d.rpm, org.tpm_limit or d.tpm
        args = (self.clock.offset, org.id, key.id if key else "", _limit(org.monthly_budget_nano),
                _limit(key.spend_limit_nano if key else None), rpm, _limit(tpm))
        r = await self._call("kiln_v1_state", *args)
        if r[0] == 0 and key is not None:
            await self._load(org, key, None)
            r = await self._call("kiln_v1_state", *args)
        if r[0] == 0:  # an organisation nobody has used through this Redis state yet
            r = [1, max(org.credits_nano, 0), "credits", 0, 0, 0, 0, 0]
        _, spendable, scope, requests_used, requests_reset, tokens_used, tokens_reset, in_flight = r
        return {
            "spendable_nano": int(spendable),
            "spendable_limited_by": scope,
            "requests_per_minute": rpm,
            "requests_left": max(rpm - int(requests_used), 0),
            "requests_reset_s": int(requests_reset),
            "tokens_per_minute": tpm,
            "tokens_left": None if tpm is None else max(tpm - int(tokens_used), 0),
            "tokens_reset_s": int(tokens_reset),
            "in_flight": int(in_flight),
            "concurrency_limit": org.concurrency_limit or d.concurrency,
        }

    # -- what the database tells Redis -------------------------------------------

    async def committed(self, events: list[UsageEvent], balances: CreditBalances) -> None:
        """The ledger committed these events: their costs leave `pending`, the balances they moved
        replace older ones. A report that does not arrive is healed by the next one and the poll."""
        gens = [e.id for e in events if e.cost_nano]
        if not gens and not balances:
            return
        flat = [x for org_id, (credits, version) in balances.items() for x in (org_id, credits, version)]
        try:
            await self._call("kiln_v1_committed", len(gens), *gens, *flat)
        except errors.GatewayError:
            pass

    async def push_balances(self, balances: CreditBalances) -> None:
        """Committed balances read from the database (top-ups, the poll)."""
        await self.committed([], balances)

    # -- Redis calls ----------------------------------------------------------------

    async def _call(self, function: str, *args: object) -> Any:
        try:
            try:
                result = await self.redis.call("FCALL", function, 1, self.prefix, *args)
            except RedisError as exc:
                if "function not found" not in str(exc).lower():
                    raise
                await self._load_library()  # Redis restarted, or a new one
                result = await self.redis.call("FCALL", function, 1, self.prefix, *args)
        except _UNREACHABLE as exc:
            self._down(exc)
            raise errors.unavailable("The gateway cannot reach its admission store (Redis); retry shortly.",
                                     headers={"Retry-After": RETRY_AFTER_S}) from None
        except RedisError:  # e.g. a script error, Redis out of memory: fail closed too
            log.exception("Redis refused %s", function)
            raise errors.unavailable("The gateway's admission store (Redis) refused the request; retry shortly.",
                                     headers={"Retry-After": RETRY_AFTER_S}) from None
        if not self.reachable:
            log.warning("Redis answers again")
            self.reachable = True
            self._wake.set()  # renew and re-register at once
        return result

    async def _probe(self) -> None:
        try:
            await self.redis.call("PING")
        except _UNREACHABLE:
            return
        log.warning("Redis answers again")
        self.reachable = True

    async def _load_library(self) -> None:
        await self.redis.call("FUNCTION", "LOAD", "REPLACE", LIBRARY)

    def _down(self, exc: BaseException) -> None:
        if self.reachable:
            log.error("Redis unreachable (%s): metered requests get 503 until it answers", exc)
        self.reachable = False

    async def _load(self, org: Org, key: ApiKey, now: float | None) -> None:
        """Load one organisation's and key's committed balances from the database into Redis; a
        burst of first requests shares one load."""
        pending = self._loading.get((org.id, key.id))
        if pending is None:
            pending = self._loading[(org.id, key.id)] = asyncio.ensure_future(self._load_once(org, key, now))
            pending.add_done_callback(lambda _: self._loading.pop((org.id, key.id), None))
        await asyncio.shield(pending)

    async def _load_once(self, org: Org, key: ApiKey, now: float | None) -> None:
        if now is None:
            try:
                seconds, micros = await self.redis.call("TIME")
            except _UNREACHABLE:
                raise errors.unavailable("The gateway cannot reach its admission store (Redis); retry shortly.",
                                         headers={"Retry-After": RETRY_AFTER_S}) from None
            now = int(seconds) + int(micros) / 1e6 + self.clock.offset
        since = None if key.spend_reset == "never" else period_start(key.spend_reset, now)
        try:
            b = await self.store.balances(org.id, key.id, month_start(now), since)
        except Exception as exc:
            log.warning("cannot load the balances of %s from the database: %s", org.id, exc)
            raise errors.unavailable("The gateway cannot read balances from its database; retry shortly.",
                                     headers={"Retry-After": "5"}) from None
        await self._call("kiln_v1_load", self.clock.offset, org.id, key.id, secrets.token_hex(8), b.credits_nano,
                         b.credits_version, b.month_spend_nano, key.spend_reset, b.key_spend_nano, int(self._seen))

    # -- background: leases, lost streams, settles that waited -------------------------

    async def _renew_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), RENEW_EVERY_S)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                if not self.reachable:  # a drained replica gets no requests: find out by itself
                    await self._probe()
                await self._retry_settles()
                await self._renew()
            except errors.GatewayError:
                pass
            except Exception:
                log.exception("renewing leases failed")

    async def _renew(self) -> None:
        leases = list(self._live.items())
        for start in range(0, len(leases), 500):
            chunk = leases[start:start + 500]
            args: list[object] = []
            for gen, lease in chunk:
                args += [gen, lease.org.id, lease.key.id, lease.key.project_id, lease.model, lease.endpoint,
                         lease.ticket.reserved_nano, lease.delivered_nano, "*" if lease.settled else lease.epoch]
            epochs = await self._call("kiln_v1_renew", self.clock.offset, LEASE_TTL_S, *args)
            for (gen, lease), epoch in zip(chunk, epochs):
                if epoch:
                    lease.epoch = epoch
                elif not lease.loaded and not lease.ticket.released and gen in self._live:
                    lease.loaded = True  # Redis lost its organisation: load it, re-register next round
                    await self._load(lease.org, lease.key, None)
                    self._wake.set()

    async def _retry_settles(self) -> None:
        for gen, (cost, tokens) in list(self._unsettled.items()):
            await self._call("kiln_v1_settle", self.clock.offset, gen, cost, tokens)
            del self._unsettled[gen]
            self._live.pop(gen, None)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            try:
                await self._sweep()
            except errors.GatewayError:
                pass
            except Exception:
                log.exception("sweeping expired leases failed")

    async def _sweep(self) -> None:
        """Bill the streams of replicas that died: what they had delivered at their last extension."""
        claimed = await self._call("kiln_v1_sweep", self.clock.offset, 100)
        if not claimed or self.ledger is None:
            return
        events = []
        for entry in claimed:
            gen, org_id, key_id, project_id, model, endpoint, delivered = entry.split("|")
            events.append(UsageEvent(id=gen, created_at=self.clock.time(), org_id=org_id, project_id=project_id,
                                     key_id=key_id, model=model, endpoint=endpoint, cost_nano=int(delivered),
                                     status="lost", cancelled=True))
        log.warning("billing %d requests lost with their gateway (lease expired)", len(events))
        await asyncio.gather(*(self.ledger.submit(e) for e in events))
        await self._call("kiln_v1_lost_done", *(e.id for e in events))


def _refusal(r: list[Any], limits: tuple[int | None, ...], count_limit: int) -> errors.GatewayError:
    """The GatewayError for an admit script's refusal, worded as MemoryAdmission words it."""
    kind = r[0]
    if kind == "pay":
        return payment_error(r[1], r[2] == 1)
    if kind == "count":
        return count_error(count_limit, int(r[1]))
    if kind == "rebuilding":
        return errors.unavailable("The gateway is rebuilding its shared admission state; retry shortly.",
                                  headers={"Retry-After": str(r[1])})
    who = r[1]
    conc, rpm, tpm = limits[:3] if who == "organisation" else limits[3:]
    if kind == "conc":
        assert conc is not None
        return concurrency_error(who, conc)
    what, used_requests, used_tokens, reset = r[2], int(r[3]), int(r[4]), int(r[5])
    limit = rpm if what == "requests" else tpm
    assert limit is not None
    return rate_error(who, limit, what, reset, rate_headers(rpm, tpm, used_requests, used_tokens))

"""Which backend serves a request, and what happens when it fails.

The pipeline asks for a backend with `acquire` (or sends through `send`,
which also fails over) and gets a `Lease`; releasing it says how the request
ended, which feeds each backend's health (kiln.health).

Choice, among a model's healthy backends that are under their `max_in_flight`:

- with an affinity key (kiln.affinity) and `[routing] affinity` on: the first
  backend on the key's consistent-hashing ring whose in-flight count is under
  (1 + affinity_balance) × its weighted share of the model's load, so a
  session stays where its prefix is cached until that backend is busier
  than the rest;
- otherwise the fewest requests in flight per unit of weight (ties by weight).

When every backend is at its `max_in_flight`, a request waits up to
`queue_timeout_s` for one to free up, then gets a 503 with Retry-After.
Health checks (`/health`, else `/v1/models`) run every interval.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from kiln import backends
from kiln.affinity import Ring
from kiln.catalog import Backend, Catalog, Model
from kiln.client import Response
from kiln.config import Routing
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.deadline import Deadline
from kiln.health import DOWN, EJECTED, HEALTHY, Ejection, Outcome
from kiln.running import running_loop
from kiln.upstream import Upstream

log = logging.getLogger("kiln.router")

class NoBackend(Exception):
    """No backend of the model is left to try."""


@dataclass(slots=True, eq=False)
class Lease:
    """One request's hold on a backend; release it exactly once (later calls do nothing)."""

    backend: Backend
    router: Router
    latency_s: float | None = None  # time to the response headers, once they came
    waiting: Deadline | None = None  # set while waiting for headers: fired early if the backend goes down
    released: bool = False

    def release(self, outcome: Outcome, latency_s: float | None = None, error: str | None = None) -> None:
        if not self.released:
            self.released = True
            self.router._release(self, outcome, self.latency_s if latency_s is None else latency_s, error)


class Router:
    def __init__(self, catalog: Catalog, upstream: Upstream, routing: Routing, health_interval_s: float = 5.0) -> None:
        self.catalog = catalog
        self.upstream = upstream
        self.routing = routing
        self.health_interval_s = health_interval_s
        self.ejection = Ejection(routing.eject_after, routing.ejection_s, routing.max_ejection_s)
        self._rings = {m.id: Ring(m.backends) for m in catalog.models}
        self._model_of = {b: m for m in catalog.models for b in m.backends}
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {m.id: deque() for m in catalog.models}
        self._awaiting_headers: dict[Backend, set[Lease]] = {b: set() for b in catalog.backends()}
        self._task: asyncio.Task[None] | None = None

    # -- choosing -----------------------------------------------------------------

    def uses_affinity(self, model: Model) -> bool:
        """Whether a routing key can matter for this model (else the caller need not compute one)."""
        return self.routing.affinity and len(model.backends) > 1

    def pick(self, model: Model, affinity: str | None, exclude: Sequence[Backend] = ()) -> Backend | None:
        """The backend for a request now, or None if every candidate is full; NoBackend if none is left."""
        pool = [b for b in model.backends if b.state.status == HEALTHY and b not in exclude]
        if not pool:  # panic: an ejected backend is better than none
            pool = [b for b in model.backends if b.state.status == EJECTED and b not in exclude]
        if not pool:
            raise NoBackend
        open_ = [b for b in pool if b.state.in_flight < b.max_in_flight]
        if not open_:
            return None
        if len(open_) == 1:
            return open_[0]
        if affinity is not None and self.routing.affinity:
            chosen = self._bounded(model, affinity, pool, open_)
            if chosen is not None:
                return chosen
        return _least_loaded(open_)

    def _bounded(self, model: Model, key: str, pool: list[Backend], open_: list[Backend]) -> Backend | None:
        """The first backend on the key's ring whose load is under its bound (bounded-load hashing).

        The average is taken as at least one request per unit of weight: below
        that no backend is busy, and a strict bound would split sessions that
        merely arrive together.
        """
        weight = sum(b.weight for b in pool)
        load = max(sum(b.state.in_flight for b in pool) + 1, weight)  # with this request
        share = (1 + self.routing.affinity_balance) * load / weight
        for b in self._rings[model.id].walk(key):
            if b in open_ and b.state.in_flight < math.ceil(share * b.weight):
                return b
        return None

    def candidates(self, model: Model) -> list[Backend]:
        """Backends for a side call that takes no slot (count_tokens' /tokenize), least loaded
        first; 503 when none is reachable."""
        healthy = [b for b in model.backends if b.state.status == HEALTHY]
        usable = healthy or [b for b in model.backends if b.state.status == EJECTED]
        if not usable:
            raise errors.unavailable(f"No backend for model '{model.id}' is available right now. Retry later.")
        return sorted(usable, key=lambda b: b.state.in_flight / b.weight)

    def failed(self, backend: Backend) -> None:
        """A side call could not connect to the backend: it is down until a health check passes."""
        before = backend.state.status
        backend.state.record(Outcome.CONNECT, None, "connection failed", self.ejection)
        self._changed(backend, before)

    async def acquire(self, model: Model, affinity: str | None, exclude: Sequence[Backend] = ()) -> Lease:
        """A lease on a backend; waits up to queue_timeout_s while all are full, then 503."""
        loop = running_loop()
        deadline = loop.time() + self.routing.queue_timeout_s
        while True:
            backend = self.pick(model, affinity, exclude)
            if backend is not None:
                backend.state.in_flight += 1
                return Lease(backend, self)
            left = deadline - loop.time()
            if left <= 0:
                retry = str(max(1, math.ceil(self.routing.queue_timeout_s)))
                raise errors.unavailable(
                    f"Every backend of model '{model.id}' is at its limit of requests in flight. Retry later.",
                    headers={"Retry-After": retry})
            freed = loop.create_future()
            waiters = self._waiters[model.id]
            waiters.append(freed)
            try:
                async with asyncio.timeout(left):
                    await freed
            except TimeoutError:
                pass
            finally:
                if not freed.done():
                    waiters.remove(freed)

    def _release(self, lease: Lease, outcome: Outcome, latency_s: float | None, error: str | None) -> None:
        backend = lease.backend
        state = backend.state
        state.in_flight -= 1
        before = state.status
        state.record(outcome, latency_s, error, self.ejection)
        self._changed(backend, before)
        self._wake(self._model_of[backend].id, 1)

    def _wake(self, model_id: str, n: int) -> None:
        waiters = self._waiters[model_id]
        while n > 0 and waiters:
            freed = waiters.popleft()
            if not freed.done():
                freed.set_result(None)
                n -= 1

    def _changed(self, backend: Backend, before: str) -> None:
        """After a state change: a backend that went down lets go of requests still waiting for its
        headers (they fail over); one that came back lets waiting requests try again."""
        status = backend.state.status
        if status == before:
            return
        if status == DOWN:
            for lease in self._awaiting_headers[backend]:
                if lease.waiting is not None:
                    lease.waiting.expire()
        self._wake(self._model_of[backend].id, len(self._waiters[self._model_of[backend].id]))

    # -- sending, with failover ------------------------------------------------------

    async def send(self, model: Model, affinity: str | None, post: Callable[[Backend], Awaitable[Response]],
                   stream: bool, exclude: Sequence[Backend] = ()) -> tuple[Response, Lease]:
        """`post(backend)` on a chosen backend until one answers 200; the response and its lease.

        Before any byte reaches the client, a failure that says another
        backend may take the request (a refused connection, a connection
        closed or no headers in time, 502/503/504) moves it on, at most
        `retries` times; a 4xx or another 5xx is the answer. The error
        raised is the last backend's, mapped for the client. `exclude`:
        backends that already failed this request.
        """
        tried: list[Backend] = list(exclude)
        last: GatewayError | None = None
        for _ in range(self.routing.retries + 1):
            try:
                lease = await self.acquire(model, affinity, tried)
            except NoBackend:
                break
            except GatewayError:  # all full: on a retry, the failure that led here says more
                if last is None:
                    raise
                break
            tried.append(lease.backend)
            try:
                return await self._attempt(lease, post, stream), lease
            except GatewayError as err:
                if not err.failover:
                    raise
                last = err
        if last is None:
            raise errors.unavailable(f"No backend for model '{model.id}' is available right now. Retry later.")
        raise last

    async def _attempt(self, lease: Lease, post: Callable[[Backend], Awaitable[Response]],
                       stream: bool) -> Response:
        """One try: the 200's response, or the GatewayError (its `failover` says whether another
        backend may do better); the lease is released on failure with what it says of the backend."""
        backend = lease.backend
        timeouts = backend.timeouts
        started = time.monotonic()
        awaiting = self._awaiting_headers[backend]
        awaiting.add(lease)
        try:
            with Deadline(timeouts.headers_s if stream else None) as lease.waiting:
                resp = await post(backend)
        except GatewayError as err:
            lease.release(outcome_of(err), time.monotonic() - started, err.message if err.outcome else None)
            raise
        except TimeoutError:
            gone = backend.state.status == DOWN  # the health check gave up on it while we waited
            why = "went down while the request waited" if gone else \
                f"sent no response headers within {timeouts.headers_s:g} s"
            lease.release(Outcome.CANCELLED if gone else Outcome.TIMEOUT, error=why)
            err = errors.timeout(f"The model backend {why}.")
            err.failover = err.backend = True
            raise err from None
        except BaseException:
            lease.release(Outcome.CANCELLED)
            raise
        finally:
            lease.waiting = None
            awaiting.discard(lease)
        lease.latency_s = time.monotonic() - started
        return resp

    # -- health checks ----------------------------------------------------------------

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(b) for b in self.catalog.backends()))

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kiln-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.probe_all()

    async def _probe(self, backend: Backend) -> None:
        problem, unreachable = await self.upstream.probe(backend, min(self.health_interval_s, 5.0))
        before = backend.state.status
        if problem is None:
            if not backend.kind:  # the first passing check: what kind of server is it
                backend.kind = await backends.detect(self.upstream, backend)
                log.info("backend %s is a %s server", backend.state.label, backend.kind)
            backend.state.check_passed()
        else:
            backend.state.check_failed(problem, unreachable)
        self._changed(backend, before)

    # -- status -----------------------------------------------------------------------

    def status(self) -> list[dict[str, object]]:
        """Every backend's state, load, latency and last error, for the admin API."""
        return [
            {
                "model": m.id,
                "url": _without_credentials(b.url),
                "upstream_model": b.model,
                "kind": b.kind or "not detected yet",
                "weight": b.weight,
                "max_in_flight": b.max_in_flight,
                **b.state.view(),
            }
            for m in self.catalog.models
            for b in m.backends
        ]


def outcome_of(err: GatewayError) -> Outcome:
    """What a failure says about the backend: its own outcome for the backend's failures, OK for
    its answers (a 4xx: the request was at fault), nothing for the gateway's own (deadline, defect,
    a client that left)."""
    if err.outcome:
        return Outcome(err.outcome)
    return Outcome.OK if err.backend else Outcome.CANCELLED


def _least_loaded(backends: list[Backend]) -> Backend:
    """Fewest requests in flight per unit of weight; ties drawn by weight."""
    best = min(b.state.in_flight / b.weight for b in backends)
    ties = [b for b in backends if b.state.in_flight / b.weight == best]
    if len(ties) == 1:
        return ties[0]
    return random.choices(ties, weights=[b.weight for b in ties])[0]


def _without_credentials(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()

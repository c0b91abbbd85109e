"""What Kiln knows about each backend's health, and the rules that change it.

A backend is in one of three states:

- healthy: takes traffic;
- ejected: it failed `eject_after` requests in a row (5xx, timeouts, broken
  streams); it gets no traffic for an interval that doubles with each
  ejection in a row (capped), and comes back on the first passing health
  check after that. If every backend of a model is ejected, the router still
  uses them (better a degraded answer than none: this is Envoy's "panic" mode);
- down: unreachable (connection refused, or two failed health checks in a
  row); no traffic until a health check passes.

Each transition is logged once; nothing here logs per request.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("kiln.router")

HEALTHY, EJECTED, DOWN = "healthy", "ejected", "down"
CHECKS_TO_DOWN = 2  # failed health checks in a row that take a reachable backend down
LATENCY_ALPHA = 0.2  # weight of the newest sample in the latency EWMA


class Outcome(enum.Enum):
    """How a request to a backend ended, as far as the backend's health is concerned."""

    OK = "ok"  # answered (a 4xx is an answer too: the request was at fault)
    CANCELLED = "cancelled"  # the client left or the gateway gave up: says nothing about the backend
    CONNECT = "connect"  # the connection was refused or could not be made
    ERROR = "error"  # 5xx, connection closed before or during the answer, malformed answer
    TIMEOUT = "timeout"  # no headers in time, or silence between chunks


@dataclass(frozen=True, slots=True)
class Ejection:
    """When a failing backend is ejected, and for how long."""

    after: int = 5  # consecutive failed requests
    base_s: float = 10.0  # the first ejection; each one in a row doubles it
    max_s: float = 300.0

    def interval(self, ejections: int) -> float:
        return min(self.base_s * 2**ejections, self.max_s)


@dataclass(slots=True)
class BackendState:
    """A backend's health and load; changed only through the methods below."""

    label: str = ""
    status: str = HEALTHY
    in_flight: int = 0
    failures: int = 0  # failed requests in a row
    check_failures: int = 0  # failed health checks in a row
    ejections: int = 0  # ejections in a row: sets the next interval
    until: float = 0.0  # ejected: no re-admission before this (monotonic)
    since: float = 0.0  # when the status last changed (monotonic)
    latency_s: float | None = None  # EWMA of the time to response headers
    last_error: str | None = None
    last_error_at: float | None = None  # Unix time
    requests: int = 0
    errors: int = 0

    def record(self, outcome: Outcome, latency_s: float | None, error: str | None, policy: Ejection) -> None:
        """Account for one finished request."""
        if outcome is Outcome.CANCELLED:
            return
        self.requests += 1
        now = time.monotonic()
        if outcome is Outcome.OK:
            self.failures = 0
            if latency_s is not None:
                old = self.latency_s
                self.latency_s = latency_s if old is None else old + LATENCY_ALPHA * (latency_s - old)
            if self.ejections and self.status == HEALTHY and now - self.since > policy.max_s:
                self.ejections = 0  # healthy long enough: the next ejection starts short again
            return
        self.errors += 1
        self._error(error or outcome.value)
        if outcome is Outcome.CONNECT:
            self._become(DOWN, f"unreachable ({self.last_error})")
            return
        self.failures += 1
        if self.status == HEALTHY and self.failures >= policy.after:
            seconds = policy.interval(self.ejections)
            self.ejections += 1
            self.until = now + seconds
            self._become(EJECTED, f"{self.failures} failed requests in a row (last: {self.last_error}); "
                                  f"out for at least {seconds:g} s")

    def check_passed(self) -> bool:
        """A health check answered; True if that re-admitted the backend."""
        self.check_failures = 0
        if self.status != HEALTHY and time.monotonic() >= self.until:  # an ejection runs its course
            self._become(HEALTHY, "health check passed")
            return True
        return False

    def check_failed(self, problem: str, unreachable: bool) -> bool:
        """A health check failed; True if that took the backend down."""
        self.check_failures += 1
        self._error(f"health check: {problem}")
        if self.status != DOWN and (unreachable or self.check_failures >= CHECKS_TO_DOWN):
            self._become(DOWN, self.last_error or problem)
            return True
        return False

    def view(self) -> dict[str, object]:
        """The admin view (no secrets: the label is the URL and model name)."""
        ejected_for = max(self.until - time.monotonic(), 0.0) if self.status == EJECTED else None
        return {
            "state": self.status,
            "in_flight": self.in_flight,
            "latency_ms": None if self.latency_s is None else round(self.latency_s * 1000, 1),
            "last_error": self.last_error,
            "last_error_at": None if self.last_error_at is None else int(self.last_error_at),
            "consecutive_failures": self.failures,
            "ejections": self.ejections,
            "ejected_for_s": None if ejected_for is None else round(ejected_for, 1),
            "requests": self.requests,
            "errors": self.errors,
        }

    def _error(self, error: str) -> None:
        self.last_error = error
        self.last_error_at = time.time()

    def _become(self, status: str, why: str) -> None:
        if status == self.status:
            return
        level = logging.INFO if status == HEALTHY else logging.WARNING
        log.log(level, "backend %s: %s -> %s: %s", self.label, self.status, status, why)
        self.status = status
        self.since = time.monotonic()
        self.failures = 0

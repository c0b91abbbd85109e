"""A backend's health states (kiln.health): the rules, checked on the state object itself.

The same rules run end to end, against killed, stopped and failing simulators,
in test_router.py.
"""

from __future__ import annotations

import logging
import time

import pytest

from kiln.health import DOWN, EJECTED, HEALTHY, BackendState, Ejection, Outcome

POLICY = Ejection(after=3, base_s=0.05, max_s=0.15)


def fail(state: BackendState, n: int, outcome: Outcome = Outcome.ERROR) -> None:
    for _ in range(n):
        state.record(outcome, None, "HTTP 503", POLICY)


def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    state = BackendState(label="b")
    fail(state, 2)
    state.record(Outcome.OK, 0.1, None, POLICY)
    fail(state, 2, Outcome.TIMEOUT)
    assert state.status == HEALTHY
    fail(state, 1)
    assert state.status == EJECTED and state.last_error == "HTTP 503"
    fail(state, 10)  # traffic an ejected backend still gets (no other left) does not extend it
    assert state.ejections == 1


def test_ejection_lasts_its_interval_doubles_and_is_capped() -> None:
    state = BackendState(label="b")
    intervals = []
    for _ in range(4):
        fail(state, 3)
        assert state.status == EJECTED
        intervals.append(round(state.until - state.since, 2))  # since: the moment of the ejection
        if not state.check_passed():  # not before its time ...
            time.sleep(max(state.until - time.monotonic(), 0) + 0.01)
            assert state.check_passed()  # ... and back on the first check after it
        assert state.status == HEALTHY
    assert intervals == [0.05, 0.1, 0.15, 0.15]


def test_cancelled_requests_say_nothing_and_4xx_answers_count_as_answers() -> None:
    state = BackendState(label="b")
    fail(state, 2)
    state.record(Outcome.CANCELLED, None, None, POLICY)
    assert state.failures == 2 and state.requests == 2
    state.record(Outcome.OK, None, None, POLICY)
    assert state.failures == 0


def test_down_on_a_refused_connection_or_two_failed_checks() -> None:
    refused = BackendState(label="b")
    refused.record(Outcome.CONNECT, None, "connection failed: [Errno 111]", POLICY)
    assert refused.status == DOWN
    assert refused.check_passed() and refused.status == HEALTHY
    slow = BackendState(label="b")
    assert not slow.check_failed("no answer within 5 s", unreachable=False)
    assert slow.status == HEALTHY
    assert slow.check_failed("no answer within 5 s", unreachable=False)
    assert slow.status == DOWN and slow.last_error == "health check: no answer within 5 s"
    gone = BackendState(label="b")
    assert gone.check_failed("unreachable", unreachable=True) and gone.status == DOWN


def test_each_transition_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    state = BackendState(label="http://10.0.0.1:8000/v1 (m)")
    with caplog.at_level(logging.INFO, logger="kiln.router"):
        fail(state, 8)
        state.record(Outcome.CONNECT, None, "connection failed", POLICY)
        state.record(Outcome.CONNECT, None, "connection failed", POLICY)
        state.check_failed("unreachable", unreachable=True)
        time.sleep(0.06)
        state.check_passed()
        state.check_passed()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert "healthy -> ejected" in messages[0] and "10.0.0.1" in messages[0]
    assert "ejected -> down" in messages[1]
    assert "down -> healthy" in messages[2]

"""Every fault a model backend can throw, through the real gateway, in the client's protocol.

The backend is tests/reliability/backend.py; the fault rides in the prompt
(`fault=NAME`), so it works from every protocol. For each fault and protocol the test
records what the client got (status, bytes, time, how a stream ended), the usage event
and its cost, and checks that no slot or reservation leaked and that the money adds up.

The expectations are issue 9's policy: a request that fails because of the backend or
the gateway costs only what reached the client (prompt + delivered tokens, or nothing),
its event is still recorded (cost 0 when nothing arrived) under the generation id the
client got, every phase is bounded by the request deadline, and a backend's usage
numbers are validated (never negative, never more than max_tokens).
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Any, Iterator

import orjson
import pytest

from conftest import Gateway, Tenant, start_gateway, stop
from reliability.backend import BIG_BYTES, DELIVERED, PROMPT_TOKENS, REPLY_TOKENS
from reliability.conftest import ADV_MODEL, MAX_BODY_BYTES, REQUEST_TIMEOUT_S, Backend, adv_toml
from reliability.harness import Answer, Books, assert_nothing_leaked, assert_protocol_error, body_for, observe, send, settle

BOUND_S = REQUEST_TIMEOUT_S + 3.0  # the deadline, plus slack for a loaded machine
MAX_TOKENS = 64
IN, OUT = Decimal("0.10"), Decimal("0.30")  # USD per 1M tokens, the adversarial model's prices


def cost(prompt: int, completion: int) -> Decimal:
    return (prompt * IN + completion * OUT) / 10**6


def run(tenant: Tenant, name: str, protocol: str, stream: bool, timeout: float = 25.0) -> tuple[Answer, Books]:
    body = body_for(protocol, ADV_MODEL, f"Say something. fault={name}", stream, MAX_TOKENS)
    answer = send(tenant, protocol, body, timeout=timeout)
    books = settle(tenant, events=1)
    observe(f"fault:{name}", protocol=protocol, stream=stream, answer=answer.summary(),
            delivered_tokens=answer.delivered_tokens() if stream else None,
            events=[{k: e[k] for k in ("id", "status", "cost", "prompt_tokens", "completion_tokens", "cancelled")}
                    for e in books.events],
            credits_used=str(books.granted - books.credits), in_flight=books.in_flight)
    return answer, books


def one_event(answer: Answer, books: Books) -> dict[str, Any]:
    """Exactly one event, under the id the client was given."""
    assert len(books.events) == 1, books.events
    event = books.events[0]
    assert answer.generation_id is not None, ("the client got no generation id", answer.summary())
    assert event["id"] == answer.generation_id, (event, answer.summary())
    return event


def assert_costs_nothing(answer: Answer, books: Books) -> None:
    event = one_event(answer, books)
    assert Decimal(event["cost"]) == 0, ("nothing reached the client, yet it was billed", event)
    assert_nothing_leaked(books)


def assert_billed_delivered(answer: Answer, books: Books) -> None:
    """The tokens the client actually received, plus the prompt; nothing if no token arrived.
    (The prompt's count is the gateway's: the backend's usage never came.)"""
    event = one_event(answer, books)
    delivered = answer.delivered_tokens()
    assert event["completion_tokens"] == delivered, ("tokens billed != tokens delivered", event, delivered)
    expected = cost(event["prompt_tokens"], delivered) if delivered else Decimal(0)
    assert Decimal(event["cost"]) == expected, event
    assert_nothing_leaked(books)


def stream_failed(answer: Answer) -> None:
    """A stream that broke: an error event in its protocol (never a clean end), within the bound."""
    if answer.status != 200:
        assert_protocol_error(answer)
    else:
        assert answer.ending == "error", answer.summary()
    assert answer.seconds <= BOUND_S, answer.summary()


@pytest.fixture
def t(adv_gateway: Gateway) -> Tenant:
    return adv_gateway.new_key(credits="1")


# -- the backend never answers, or stops answering ----------------------------------------


@pytest.mark.parametrize("protocol", ["chat", "responses"])
def test_hang_before_headers_json(t: Tenant, protocol: str) -> None:
    answer, books = run(t, "hang_headers", protocol, stream=False)
    assert_protocol_error(answer, 504)
    assert answer.seconds <= BOUND_S, answer.summary()
    assert_costs_nothing(answer, books)


@pytest.mark.parametrize("protocol", ["chat", "messages"])
def test_hang_before_headers_stream(t: Tenant, protocol: str) -> None:
    answer, books = run(t, "hang_headers", protocol, stream=True)
    stream_failed(answer)
    assert_costs_nothing(answer, books)


@pytest.mark.parametrize("protocol,stream", [("chat", True), ("completions", False)])
def test_headers_then_silence(t: Tenant, protocol: str, stream: bool) -> None:
    answer, books = run(t, "headers_silence", protocol, stream=stream)
    if stream:
        stream_failed(answer)
    else:
        assert_protocol_error(answer, 504)
        assert answer.seconds <= BOUND_S, answer.summary()
    assert_costs_nothing(answer, books)


@pytest.mark.parametrize("protocol", ["chat", "messages"])
def test_slow_first_byte_is_served_and_billed_exactly(t: Tenant, protocol: str) -> None:
    """Slow but within the deadline: the whole answer, keepalives meanwhile, exact usage."""
    answer, books = run(t, "slow_first_byte", protocol, stream=True)
    assert answer.status == 200 and answer.ending == "complete", answer.summary()
    assert answer.delivered_tokens() == REPLY_TOKENS
    event = one_event(answer, books)
    assert Decimal(event["cost"]) == cost(PROMPT_TOKENS, REPLY_TOKENS), event
    assert_nothing_leaked(books)


def test_trickle_is_cut_at_the_deadline_and_billed_for_what_arrived(t: Tenant) -> None:
    answer, books = run(t, "trickle", "chat", stream=True)
    stream_failed(answer)
    assert answer.delivered_tokens() <= REPLY_TOKENS, answer.summary()  # cut before its end, at the deadline
    assert_billed_delivered(answer, books)


# -- the backend fails --------------------------------------------------------------------


@pytest.mark.parametrize("protocol,stream", [("chat", False), ("completions", True), ("messages", True)])
def test_backend_500(t: Tenant, protocol: str, stream: bool) -> None:
    answer, books = run(t, "http_500", protocol, stream=stream)
    assert_protocol_error(answer, 502)
    assert answer.seconds <= BOUND_S, answer.summary()
    assert_costs_nothing(answer, books)


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_drop_mid_stream(t: Tenant, protocol: str) -> None:
    answer, books = run(t, "drop_mid", protocol, stream=True)
    stream_failed(answer)
    assert answer.delivered_tokens() == DELIVERED, answer.summary()
    assert_billed_delivered(answer, books)


def test_drop_mid_json_body(t: Tenant) -> None:
    answer, books = run(t, "drop_mid", "chat", stream=False)
    assert_protocol_error(answer, 502)
    assert_costs_nothing(answer, books)


@pytest.mark.parametrize("protocol", ["chat", "completions", "messages"])
def test_garbage_mid_stream_ends_with_an_error(t: Tenant, protocol: str) -> None:
    """Not a clean [DONE]: a client must be able to tell the answer is incomplete."""
    answer, books = run(t, "garbage_mid", protocol, stream=True)
    stream_failed(answer)
    assert answer.delivered_tokens() == DELIVERED, answer.summary()
    assert_billed_delivered(answer, books)


def test_huge_sse_line_is_refused_quickly(t: Tenant) -> None:
    """A 32 MiB line: capped and refused in bounded time (not parsed quadratically)."""
    answer, books = run(t, "huge_line", "chat", stream=True, timeout=60)
    assert answer.delivered_tokens() == 0, ("the huge line reached the client", answer.summary())
    stream_failed(answer)
    assert_costs_nothing(answer, books)


def test_huge_json_body_is_refused(t: Tenant) -> None:
    answer, books = run(t, "huge_json", "chat", stream=False, timeout=60)
    assert_protocol_error(answer, 502)
    assert f"larger than {MAX_BODY_BYTES} bytes" in answer.raw.decode(), answer.summary()
    assert answer.seconds <= BOUND_S, answer.summary()
    assert_costs_nothing(answer, books)


def test_big_json_body_arrives_whole(t: Tenant) -> None:
    """An answer far larger than one network read, under the limit, reaches the client whole
    (a body read in one call of the transport came back cut at what had arrived)."""
    answer, books = run(t, "big_json", "chat", stream=False, timeout=60)
    assert answer.status == 200, answer.summary()
    assert orjson.loads(answer.raw)["choices"][0]["message"]["content"] == "y" * BIG_BYTES
    assert len(books.events) == 1 and books.events[0]["status"] == "ok", books.events


# -- the backend lies about usage -----------------------------------------------------------


@pytest.mark.parametrize("protocol,stream", [("chat", False), ("messages", True)])
def test_negative_usage_never_adds_credits(t: Tenant, protocol: str, stream: bool) -> None:
    answer, books = run(t, "negative_usage", protocol, stream=stream)
    assert answer.status == 200, answer.summary()
    event = one_event(answer, books)
    assert event["prompt_tokens"] >= 0 and 0 <= event["completion_tokens"] <= MAX_TOKENS, event
    assert Decimal(event["cost"]) >= 0, event
    assert_nothing_leaked(books)


@pytest.fixture
def own_gateway(adv: Backend) -> Iterator[Gateway]:
    """A gateway of its own: a wedged ledger must not take the others' tests with it."""
    gw = start_gateway(adv_toml(adv.url, "shutdown_grace_s = 3"))
    yield gw
    stop(gw.proc)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_absurd_usage_is_bounded_and_does_not_wedge_the_ledger(own_gateway: Gateway, stream: bool) -> None:
    """10^19 completion tokens is more than 2^63 nanodollars: validated to max_tokens at most,
    and another organisation's request right after it is served and metered."""
    t = own_gateway.new_key(credits="1")
    answer = send(t, "chat", body_for("chat", ADV_MODEL, "fault=absurd_usage", stream, MAX_TOKENS), timeout=8)
    other = own_gateway.new_key(credits="1")
    started = time.monotonic()
    follow = send(other, "chat", body_for("chat", ADV_MODEL, "hello", False, MAX_TOKENS), timeout=8)
    follow_s = time.monotonic() - started
    books = settle(t, events=1, timeout=5)
    started = time.monotonic()
    own_gateway.proc.terminate()
    try:
        own_gateway.proc.wait(12)
    except Exception:
        own_gateway.proc.kill()
    stop_s = time.monotonic() - started
    observe("fault:absurd_usage", stream=stream, answer=answer.summary(), follow_up=follow.summary(),
            follow_up_seconds=round(follow_s, 2), sigterm_exit_seconds=round(stop_s, 2), events=books.events,
            credits_used=str(books.granted - books.credits))
    assert answer.status == 200, answer.summary()
    assert follow.status == 200 and follow_s < 8, ("the ledger is wedged", follow.summary())
    event = one_event(answer, books)
    assert 0 <= event["completion_tokens"] <= MAX_TOKENS, event
    assert Decimal(event["cost"]) <= cost(32768, MAX_TOKENS), event
    assert_nothing_leaked(books)
    assert stop_s < 10, "SIGTERM did not stop the gateway"

"""POST /v1/chat/completions when things go wrong: the gateway's own errors, the
model server's errors, broken streams, oversized bodies and clients that leave.

Contract points checked throughout: OpenAI-shaped JSON errors (plain text for
502), the SDK's exception classes with `.code`/`.param`, no
X-Neocloud-Generation-Id on a response to the client's own mistake, a failure
of the gateway or the backend recorded at no cost under the generation id the
client receives (the billing policy: a failure costs only what reached the
client), and every generation id the client sees naming a usage event.
"""

from __future__ import annotations

import json
import socket
from decimal import Decimal
from typing import Any, Iterator
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from conftest import (
    HELLO, OSS, QWEN, QWEN_UPSTREAM, Gateway, Sim, Tenant, assert_recorded_at_no_cost, catalog_toml, new_tag,
    start_gateway, start_sim, stop, wait_for,
)

MIB = 1024 * 1024


# -- helpers ---------------------------------------------------------------------------------


def post(tenant: Tenant, body: dict[str, Any], **kw: Any) -> httpx.Response:
    with tenant.http() as client:
        return client.post("/v1/chat/completions", json=body, **kw)


def read_stream(tenant: Tenant, body: dict[str, Any]) -> tuple[httpx.Response, str]:
    with tenant.http() as client, client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        raw = r.read().decode()
    return r, raw


def data_payloads(raw: str) -> list[Any]:
    out = []
    for frame in (f for f in raw.split("\n\n") if f):
        if frame.startswith("data: "):
            payload = frame[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def never_reached(sim: Sim, tag: str) -> None:
    assert sim.tagged(tag) is None, "a request the gateway rejected reached the model server"


def assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if status < 500:  # the client's own mistake: nothing recorded
        assert "x-neocloud-generation-id" not in resp.headers
    return err


def assert_plain_502(resp: httpx.Response) -> str:
    assert resp.status_code == 502, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    assert resp.text.strip() and not resp.text.lstrip().startswith("{")
    return resp.text


def event_for(tenant: Tenant, gen_id: str) -> dict[str, Any] | None:
    return next((e for e in tenant.usage() if e["id"] == gen_id), None)


# -- errors the model server returns -------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 422])
def test_upstream_rejection_is_400_with_its_message_and_not_billed(tenant: Tenant, status: int) -> None:
    message = "Invalid value for `top_k`: must be -1 or at least 1, got 0."
    resp = post(tenant, {"model": QWEN, "messages": HELLO, "sim": {"status": status, "error_message": message}})
    err = assert_openai_error(resp, 400)
    assert err["message"] == message
    assert err["type"] == "invalid_request_error"
    assert tenant.usage() == []
    assert Decimal(tenant.org()["credits"]) == Decimal("10")


def test_upstream_rejection_raises_bad_request_in_the_sdk(tenant: Tenant) -> None:
    message = "Simulated upstream validation failure."
    with pytest.raises(openai.BadRequestError) as exc:
        tenant.openai().chat.completions.create(
            model=QWEN, messages=HELLO, extra_body={"sim": {"status": 400, "error_message": message}}
        )
    assert exc.value.status_code == 400
    assert message in exc.value.message
    assert exc.value.body["message"] == message


def test_upstream_rejection_of_a_stream_is_a_plain_400_before_the_stream_starts(tenant: Tenant) -> None:
    message = "Simulated upstream validation failure."
    r, raw = read_stream(tenant, {"model": QWEN, "messages": HELLO, "sim": {"status": 400, "error_message": message}})
    assert r.status_code == 400, raw
    assert r.headers["content-type"].startswith("application/json")
    assert json.loads(raw)["error"]["message"] == message
    assert "x-neocloud-generation-id" not in r.headers
    assert tenant.usage() == []


def test_upstream_rejection_after_the_stream_committed_is_an_in_stream_error(tenant: Tenant) -> None:
    """The backend is silent longer than one keepalive interval, then rejects: the 200 is already sent."""
    message = "Simulated late rejection."
    body = {"model": QWEN, "messages": HELLO, "sim": {"delay_ms": 1200, "status": 400, "error_message": message}}
    r, raw = read_stream(tenant, body)
    assert r.status_code == 200
    payloads = data_payloads(raw)
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert len(errors) == 1 and errors[0]["error"]["message"] == message
    assert not any(isinstance(p, dict) and p.get("choices") for p in payloads)
    events = tenant.usage()
    assert all(Decimal(e["cost"]) == 0 for e in events), "nothing was generated: nothing is billed"
    gen_id = r.headers.get("x-neocloud-generation-id")
    if gen_id is not None:
        assert gen_id in {e["id"] for e in events}, "the generation id sent to the client names no usage event"


def test_upstream_rejection_after_commit_raises_in_the_sdk(tenant: Tenant) -> None:
    stream = tenant.openai().chat.completions.create(
        model=QWEN, messages=HELLO, stream=True,
        extra_body={"sim": {"delay_ms": 1200, "status": 400, "error_message": "Late rejection."}},
    )
    with pytest.raises(openai.APIError) as exc:
        list(stream)
    assert "Late rejection." in exc.value.message


def test_context_overflow_is_400_with_the_upstream_wording(tenant: Tenant) -> None:
    prompt = "word " * 40_000  # one token per word on the simulator; its max_model_len is 32768
    resp = post(tenant, {"model": QWEN, "messages": [{"role": "user", "content": prompt}]})
    err = assert_openai_error(resp, 400)
    assert "maximum context length is 32768 tokens" in err["message"]
    assert "40" in err["message"]  # the prompt's size, as the backend counted it
    assert tenant.usage() == []
    with pytest.raises(openai.BadRequestError) as exc:
        tenant.openai().chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": prompt}], stream=True
        )
    assert "maximum context length" in exc.value.message


@pytest.fixture(scope="module")
def small_context() -> Iterator[tuple[Sim, Gateway]]:
    """A simulator with a 64-token context and a gateway of its own."""
    small = start_sim("--model", QWEN_UPSTREAM, "--model", OSS, "--max-model-len", "64")
    gw = start_gateway(catalog_toml(small.url))
    try:
        yield small, gw
    finally:
        stop(gw.proc)
        stop(small.proc)


def test_context_overflow_on_a_small_model_through_the_sdk(small_context: tuple[Sim, Gateway]) -> None:
    _, gw = small_context
    tenant = gw.new_key()
    ok = tenant.openai().chat.completions.create(model=QWEN, messages=HELLO)
    assert ok.choices[0].finish_reason in ("stop", "length")
    long = [{"role": "user", "content": "tell me about " + "rivers and stones " * 30}]
    with pytest.raises(openai.BadRequestError) as exc:
        tenant.openai().chat.completions.create(model=QWEN, messages=long)
    assert exc.value.status_code == 400
    assert "maximum context length is 64 tokens" in exc.value.message
    assert len(tenant.usage()) == 1  # only the request that fitted


def test_upstream_500_is_a_plain_text_502_recorded_at_no_cost(tenant: Tenant) -> None:
    resp = post(tenant, {"model": QWEN, "messages": HELLO, "sim": {"status": 500}})
    assert_plain_502(resp)
    assert_recorded_at_no_cost(tenant, resp)
    r, raw = read_stream(tenant, {"model": QWEN, "messages": HELLO, "sim": {"status": 500}})
    assert r.status_code == 502 and r.headers["content-type"].startswith("text/plain")
    assert_recorded_at_no_cost(tenant, r)
    assert len(tenant.usage()) == 2
    with pytest.raises(openai.InternalServerError) as exc:
        tenant.openai().chat.completions.create(model=QWEN, messages=HELLO, extra_body={"sim": {"status": 500}})
    assert exc.value.status_code == 502


@pytest.mark.parametrize("status", [401, 403, 404, 500, 501])
def test_upstream_errors_that_are_not_the_clients_fault_are_502(tenant: Tenant, status: int) -> None:
    """A backend 401/403 (wrong backend key) must not look like a problem with the client's own key."""
    resp = post(tenant, {"model": QWEN, "messages": HELLO, "sim": {"status": status, "error_message": "backend says no"}})
    assert_plain_502(resp)
    assert_recorded_at_no_cost(tenant, resp)


@pytest.mark.parametrize("status", [429, 503])
def test_overloaded_backend_is_503(tenant: Tenant, status: int) -> None:
    resp = post(tenant, {"model": QWEN, "messages": HELLO, "sim": {"status": status}})
    err = assert_openai_error(resp, 503)
    assert err["message"]
    assert_recorded_at_no_cost(tenant, resp)


def test_offline_backend_is_502_then_503(tenant: Tenant) -> None:
    first = post(tenant, {"model": "offline-model", "messages": HELLO})
    assert first.status_code in (502, 503), first.text
    if first.status_code == 502:
        assert_plain_502(first)
    assert_recorded_at_no_cost(tenant, first)
    second = post(tenant, {"model": "offline-model", "messages": HELLO})
    err = assert_openai_error(second, 503)
    assert "offline-model" in err["message"]
    assert_recorded_at_no_cost(tenant, second)
    r, raw = read_stream(tenant, {"model": "offline-model", "messages": HELLO})
    assert r.status_code == 503, raw
    assert_recorded_at_no_cost(tenant, r)
    with pytest.raises(openai.InternalServerError) as exc:
        tenant.openai().chat.completions.create(model="offline-model", messages=HELLO)
    assert exc.value.status_code == 503


# -- broken streams ------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["drop_after", "error_after"])
def test_stream_broken_mid_way_ends_with_an_in_stream_error(tenant: Tenant, fault: str) -> None:
    body = {
        "model": QWEN, "messages": HELLO, "stream_options": {"include_usage": True},
        "sim": {fault: 5, "token_delay_ms": 5},
    }
    r, raw = read_stream(tenant, body)
    assert r.status_code == 200
    payloads = data_payloads(raw)
    chunks = [p for p in payloads if isinstance(p, dict) and "choices" in p]
    errors = [p for p in payloads if isinstance(p, dict) and "error" in p]
    assert chunks, "the chunks before the failure were delivered"
    assert len(errors) == 1
    err = errors[0]["error"]
    assert err["message"] and "type" in err
    assert payloads.index(errors[0]) > payloads.index(chunks[-1]), "the error comes after the delivered chunks"
    assert not any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), "no clean finish"
    assert not any(c.get("usage") for c in chunks), "no usage chunk for a broken stream"
    gen_id = r.headers["x-neocloud-generation-id"]
    event = wait_for(lambda: event_for(tenant, gen_id), what="the usage event of the broken stream")
    assert event["status"] == "error"


def test_chunks_sent_just_before_a_drop_are_not_lost(tenant: Tenant) -> None:
    """The backend writes five chunks in one burst and then drops the connection.

    Those chunks reached the gateway; they must reach the client (and be
    billed) before the in-stream error. Repeated because the loss depends on
    whether the data and the connection close arrive in the same read.
    """
    for attempt in range(10):
        r, raw = read_stream(tenant, {"model": QWEN, "messages": HELLO, "sim": {"drop_after": 5}})
        payloads = data_payloads(raw)
        chunks = [p for p in payloads if isinstance(p, dict) and "choices" in p]
        assert [p for p in payloads if isinstance(p, dict) and "error" in p], raw
        assert len(chunks) == 5, f"attempt {attempt}: {len(chunks)} of the 5 chunks the backend sent were delivered"


@pytest.mark.parametrize("fault", ["drop_after", "error_after"])
def test_stream_broken_mid_way_raises_in_the_sdk(tenant: Tenant, fault: str) -> None:
    stream = tenant.openai().chat.completions.create(
        model=QWEN, messages=HELLO, stream=True, extra_body={"sim": {fault: 5, "token_delay_ms": 5}}
    )
    received = []
    with pytest.raises(openai.APIError):
        for chunk in stream:
            received.append(chunk)
    assert received, "chunks before the failure reach the SDK"


@pytest.mark.parametrize("fault", ["drop_after", "error_after"])
def test_json_response_broken_by_the_backend_is_a_502(tenant: Tenant, fault: str) -> None:
    resp = post(tenant, {"model": QWEN, "messages": HELLO, "sim": {fault: 3}})
    assert_plain_502(resp)
    assert_recorded_at_no_cost(tenant, resp)


# -- the gateway's own errors and the SDK's exception classes ---------------------------------------


def test_missing_key_is_authentication_error(gateway: Gateway, sim: Sim) -> None:
    tag = new_tag()
    with gateway.http() as client:
        resp = client.post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "sim": {"tag": tag}})
    err = assert_openai_error(resp, 401)
    assert err["code"] == "invalid_api_key"
    never_reached(sim, tag)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-kiln-not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.chat.completions.create(model=QWEN, messages=HELLO)
    assert exc.value.status_code == 401
    assert exc.value.code == "invalid_api_key"
    assert "x-neocloud-generation-id" not in exc.value.response.headers


def test_non_bearer_authorization_is_401_without_x_api_key_fallback(tenant: Tenant) -> None:
    with httpx.Client(base_url=tenant.gw.url, timeout=30) as client:
        resp = client.post(
            "/v1/chat/completions",
            json={"model": QWEN, "messages": HELLO},
            headers={"Authorization": f"Basic {tenant.key}", "x-api-key": tenant.key},
        )
    assert_openai_error(resp, 401)
    assert tenant.usage() == []


@pytest.mark.parametrize("action", ["suspend", "revoke"])
def test_inactive_key_is_permission_denied(tenant: Tenant, action: str) -> None:
    r = tenant.gw.admin.post(f"/keys/{tenant.key_id}/{action}")
    assert r.status_code == 200, r.text
    with pytest.raises(openai.PermissionDeniedError) as exc:
        tenant.openai().chat.completions.create(model=QWEN, messages=HELLO)
    assert exc.value.status_code == 403
    assert exc.value.code and exc.value.code.startswith("key_")
    assert "x-neocloud-generation-id" not in exc.value.response.headers
    assert tenant.usage() == []


def test_exhausted_credits_is_402(gateway: Gateway) -> None:
    tenant = gateway.new_key(credits="0")
    with pytest.raises(openai.APIStatusError) as exc:
        tenant.openai().chat.completions.create(model=QWEN, messages=HELLO)
    assert exc.value.status_code == 402
    assert exc.value.code == "credits_exhausted"
    assert "x-neocloud-generation-id" not in exc.value.response.headers
    assert tenant.usage() == []


def test_requests_per_minute_limit_is_rate_limit_error(gateway: Gateway) -> None:
    tenant = gateway.new_key(rpm_limit=1)
    client = tenant.openai()
    client.chat.completions.create(model=QWEN, messages=HELLO)
    with pytest.raises(openai.RateLimitError) as exc:
        client.chat.completions.create(model=QWEN, messages=HELLO)
    assert exc.value.status_code == 429
    assert exc.value.code == "rate_limit_exceeded"
    assert int(exc.value.response.headers["x-ratelimit-reset"]) >= 1
    assert "x-neocloud-generation-id" not in exc.value.response.headers
    assert len(tenant.usage()) == 1


def test_concurrency_limit_is_429_without_rate_limit_headers(gateway: Gateway) -> None:
    tenant = gateway.new_key(concurrency_limit=1)
    slow = {"model": QWEN, "messages": HELLO, "stream": True, "sim": {"ttft_ms": 1500}}
    with tenant.http() as client, client.stream("POST", "/v1/chat/completions", json=slow) as running:
        assert running.status_code == 200
        second = post(tenant, {"model": QWEN, "messages": HELLO})
        err = assert_openai_error(second, 429)
        assert err["code"] == "rate_limit_exceeded"
        assert not [h for h in second.headers if h.startswith("x-ratelimit")]
        running.read()
    third = post(tenant, {"model": QWEN, "messages": HELLO})
    assert third.status_code == 200, "the slot is free again once the stream ended"


def test_unknown_model_is_not_found_error(tenant: Tenant) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        tenant.openai().chat.completions.create(model="llama-9000", messages=HELLO, stream=True)
    assert exc.value.code == "model_not_found"
    assert exc.value.param == "model"
    assert exc.value.type and "llama-9000" in exc.value.message
    assert tenant.usage() == []


def test_bad_request_error_carries_code_and_param(tenant: Tenant) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        tenant.openai().chat.completions.create(model=OSS, messages=HELLO, extra_body={"ignore_eos": True})
    assert (exc.value.code, exc.value.param, exc.value.type) == ("unsupported_parameter", "ignore_eos", "invalid_request_error")


def test_wrong_method_is_405_json(tenant: Tenant) -> None:
    with tenant.http() as client:
        resp = client.get("/v1/chat/completions")
    assert_openai_error(resp, 405)


# -- body size -------------------------------------------------------------------------------------


def test_body_over_8_mib_is_413(tenant: Tenant, sim: Sim) -> None:
    tag = new_tag()
    body = {"model": QWEN, "messages": [{"role": "user", "content": "x" * (9 * MIB)}], "sim": {"tag": tag}}
    try:
        resp = post(tenant, body)
    except httpx.TransportError as exc:  # the gateway may close before the client finished writing
        pytest.fail(f"the client got no 413 response: {exc!r}")
    err = assert_openai_error(resp, 413)
    assert err["message"]
    never_reached(sim, tag)
    assert tenant.usage() == []


def test_chunked_body_over_8_mib_is_413(tenant: Tenant) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"model": "qwen3-32b", "messages": [{"role": "user", "content": "'
        for _ in range(9 * 16):
            yield b"y" * (64 * 1024)
        yield b'"}]}'

    try:
        with tenant.http() as client:
            resp = client.post("/v1/chat/completions", content=body(), headers={"content-type": "application/json"})
    except httpx.TransportError as exc:
        pytest.fail(f"the client got no 413 response: {exc!r}")
    assert_openai_error(resp, 413)
    assert resp.headers["connection"] == "close"
    assert tenant.usage() == []


def test_large_content_length_is_refused_without_reading_the_body(tenant: Tenant) -> None:
    """Declare 100 MiB, send a few bytes, and wait: the 413 must come without the rest."""
    url = urlsplit(tenant.gw.url)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"Host: {url.hostname}:{url.port}\r\n"
        f"Authorization: Bearer {tenant.key}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {100 * MIB}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port), timeout=5) as s:
        s.sendall(head + b'{"model": "qwen3-32b", "messages": [')
        try:
            reply = s.recv(65536)
        except TimeoutError:
            pytest.fail("the gateway waited for the 100 MiB body instead of answering 413")
    status_line = reply.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"x-neocloud-generation-id" not in reply.lower()
    assert b"connection: close" in reply.lower()  # the unread body is not the next request


def test_body_under_the_limit_is_accepted(tenant: Tenant, sim: Sim) -> None:
    tag = new_tag()
    body = {"model": QWEN, "messages": HELLO, "padding": "z" * (6 * MIB), "sim": {"tag": tag}}
    resp = post(tenant, body)
    assert resp.status_code == 200, resp.text[:300]
    assert resp.headers["x-neocloud-generation-id"]
    sim.http.delete("/sim/requests")  # do not keep 6 MiB in the simulator's request log for later tests


# -- clients that leave ----------------------------------------------------------------------------


def test_abandoned_json_request_is_cancelled_upstream(tenant: Tenant, sim: Sim) -> None:
    wait_for(lambda: sim.stats()["in_flight"] == 0, what="an idle simulator")
    before = sim.stats()
    with pytest.raises(httpx.ReadTimeout):
        with tenant.http() as client:
            client.post(
                "/v1/chat/completions",
                json={"model": QWEN, "messages": HELLO, "sim": {"delay_ms": 3000}},
                timeout=httpx.Timeout(30, read=0.5),
            )
    stats = wait_for(
        lambda: (s := sim.stats())["cancelled"] > before["cancelled"] and s["in_flight"] == 0 and s,
        timeout=2.5,  # well before the simulated 3 s delay would have ended
        what="the simulator to see the cancellation",
    )
    assert stats["completed"] == before["completed"]
    event = wait_for(lambda: tenant.usage(), what="the usage event of the abandoned request")[0]
    assert event["cancelled"] is True
    assert event["status"] == "cancelled"
    assert event["completion_tokens"] == 0
    assert wait_for(lambda: tenant.org()["in_flight"] == 0, what="the admission slot to be released")



def test_a_malformed_backend_answer_is_a_502_never_a_500(tenant: Tenant) -> None:
    with tenant.http() as c:
        r = c.post("/v1/chat/completions", json={"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}],
                                                 "sim": {"malformed": True}})
        assert r.status_code == 502 and r.headers["content-type"].startswith("text/plain")
        # A stream whose first event is garbage: nothing went out yet, so the client gets the
        # status too (the 200 goes out with the first frames); once frames went out, the error
        # comes in the stream (test_garbage_mid_stream_ends_with_an_error).
        s = c.post("/v1/chat/completions", json={
            "model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "sim": {"malformed": True, "stream_malformed": True},
        })
        assert s.status_code == 502 and s.headers["content-type"].startswith("text/plain")
        assert "malformed" in s.text and s.headers["x-neocloud-generation-id"].startswith("gen-")
    assert all(e["cost"] == "0" for e in tenant.usage())

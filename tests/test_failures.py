"""Money and service when requests misbehave: several outputs against a small balance, a key
revoked while its stream runs, and backends that hang in each phase of a request.

Billing policy (README "Billing"): a failure of the gateway or the backend costs only what
reached the client; the event is recorded under the id the client received.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from typing import Any, Iterator

import httpx
import pytest

from conftest import HELLO, QWEN, Gateway, Sim, Tenant, catalog_toml, start_gateway, stop, wait_for
from sse import SSE

OUTPUT_NANO = 300  # qwen3-32b in the session catalog: $0.30 per 1M output tokens


def spend(tenant: Tenant) -> Decimal:
    org = tenant.org()
    return Decimal(org["total_granted"]) - Decimal(org["credits"])


def test_many_prompts_reserve_for_every_output(tenant: Tenant, gateway: Gateway) -> None:
    """200 prompts x 100 tokens would cost 6x the balance: each output is capped to what it covers."""
    small = gateway.new_key(credits="0.001")
    body = {"model": QWEN, "prompt": [f"p{i}" for i in range(200)], "max_tokens": 100,
            "sim": {"reply_tokens": 100}}
    r = small.http().post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    per_output = int(r.headers["x-kiln-output-capped"])
    assert 0 < per_output < 100
    data = r.json()
    assert len(data["choices"]) == 200
    assert data["usage"]["completion_tokens"] <= per_output * 200
    assert spend(small) <= Decimal("0.001") and Decimal(small.org()["credits"]) >= 0
    refused = small.http().post("/v1/completions", json={**body, "prompt": [f"q{i}" for i in range(5000)]})
    assert refused.status_code == 402, refused.text


def test_several_choices_in_a_stream_stay_within_the_bound(gateway: Gateway) -> None:
    small = gateway.new_key(credits="0.0005")
    body = {"model": QWEN, "messages": HELLO, "n": 4, "max_tokens": 2000, "stream": True,
            "sim": {"reply_tokens": 2000}}
    with small.http() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        raw = r.read().decode()
    assert r.status_code == 200 and "kiln_note" in raw  # cut when the money ran out
    bound = Decimal(4 * OUTPUT_NANO) / 10**9  # one chunk per output in flight
    assert spend(small) <= Decimal("0.0005") + bound
    [event] = small.usage()
    assert Decimal(event["cost"]) == spend(small)


def test_a_key_revoked_while_it_streams_is_stopped_at_its_next_extension(gateway: Gateway) -> None:
    tenant = gateway.new_key()
    body = {"model": QWEN, "messages": HELLO, "max_tokens": 6000, "stream": True,
            "sim": {"reply_tokens": 6000, "token_delay_ms": 1}}
    seen: list[str] = []
    with tenant.http() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            seen.append(line)
            if len(seen) == 1200:  # past the first block of 512 tokens
                assert gateway.admin.post(f"/keys/{tenant.key_id}/revoke").status_code == 200
        gen_id = r.headers["x-neocloud-generation-id"]
    errors = [line for line in seen if line.startswith('data: {"error"')]
    assert len(errors) == 1 and "key_revoked" in errors[0]
    chunks = sum(1 for line in seen if line.startswith('data: {"id"'))
    assert chunks < 3000, "the stream ran on after the key was revoked"
    event = wait_for(lambda: next((e for e in tenant.usage() if e["id"] == gen_id), None), what="its event")
    assert event["completion_tokens"] > 0 and Decimal(event["cost"]) > 0  # what was delivered is billed


@pytest.fixture(scope="module")
def impatient(sim: Sim) -> Iterator[Gateway]:
    """A gateway with a 2 s request deadline and a 1 s stream idle limit."""
    config = catalog_toml(sim.url).replace("[server]", "[server]\nrequest_timeout_s = 2") + \
        "\n[routing]\nidle_timeout_s = 1\n"
    gw = start_gateway(config)
    yield gw
    stop(gw.proc)


def timed(tenant: Tenant, body: dict[str, Any]) -> tuple[httpx.Response, str, float]:
    started = time.monotonic()
    with tenant.http() as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        raw = r.read().decode()
    return r, raw, time.monotonic() - started


@pytest.mark.parametrize("fault", [{"delay_ms": 8000}, {"ttft_ms": 8000}, {"token_delay_ms": 4000}],
                         ids=["hangs-before-headers", "headers-then-silence", "silence-mid-stream"])
def test_every_phase_of_a_hanging_backend_is_bounded(impatient: Gateway, fault: dict[str, Any]) -> None:
    tenant = impatient.new_key()
    r, raw, took = timed(tenant, {"model": QWEN, "messages": HELLO, "stream": True, "sim": fault})
    assert took < 4, f"a hanging backend held the stream {took:.1f} s past a 2 s deadline"
    assert r.status_code in (200, 504) and ('"timeout_error"' in raw or r.status_code == 504), raw[-300:]
    assert tenant.http().get("/v1/key").json()["rate_limits"]["in_flight"] == 0  # the slot is free again
    [event] = tenant.usage()
    assert event["status"] == "timeout"
    deltas = [c["choices"][0]["delta"] for c in SSE(r.status_code, r.headers, raw).chunks if c.get("choices")]
    delivered = sum(1 for d in deltas if d.get("content") or d.get("reasoning"))
    if delivered:  # the prompt and what reached the client
        assert Decimal(event["cost"]) > 0 and event["completion_tokens"] == delivered
    else:
        assert Decimal(event["cost"]) == 0  # nothing reached the client: nothing is billed


def test_a_hanging_json_request_is_a_504_recorded_at_no_cost(impatient: Gateway) -> None:
    tenant = impatient.new_key()
    started = time.monotonic()
    r = tenant.http().post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO,
                                                         "sim": {"delay_ms": 8000}})
    assert r.status_code == 504 and time.monotonic() - started < 4
    gen_id = r.headers["x-neocloud-generation-id"]
    [event] = tenant.usage()
    assert (event["id"], event["status"], Decimal(event["cost"])) == (gen_id, "timeout", 0)


def test_concurrent_hangs_do_not_lock_the_organisation_out(impatient: Gateway) -> None:
    """Eight hanging streams used to hold all eight slots for as long as the backend hung."""
    tenant = impatient.new_key(concurrency_limit=8)
    body = {"model": QWEN, "messages": HELLO, "stream": True, "sim": {"ttft_ms": 8000}}
    threads = [threading.Thread(target=timed, args=(tenant, body)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    r = tenant.http().post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "max_tokens": 4})
    assert r.status_code == 200, r.text

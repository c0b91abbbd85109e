"""Metrics and the access log, fed by the request path of a real gateway.

A gateway of its own (so its counts are this test's), its metrics on a port
of their own; requests of every kind through it; then what Prometheus would
scrape and what the log says, one line per request, never a secret.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import HELLO, QWEN, Sim, catalog_toml, free_port, start_gateway, stop, wait_for


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def access_lines(log_text: str) -> list[dict[str, Any]]:
    out = []
    for line in log_text.splitlines():
        if line.startswith("{") and '"endpoint"' in line:
            out.append(json.loads(line))
    return out


def test_requests_refusals_keepalives_and_log_lines(sim: Sim) -> None:
    port = free_port()
    gw = start_gateway(catalog_toml(sim.url) + f"\n[metrics]\nport = {port}\n")
    try:
        tenant = gw.new_key(rpm_limit=7)
        with tenant.http() as client:
            ok = client.post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "max_tokens": 8})
            streamed = client.post("/v1/chat/completions", json={
                "model": QWEN, "max_tokens": 8, "stream": True, "messages": HELLO,
                "sim": {"ttft_ms": 1200}})  # keepalives while the first token is slow
            messages = client.post("/v1/messages", json={"model": QWEN, "max_tokens": 8, "messages": HELLO})
            failed = client.post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO,
                                                               "sim": {"status": 500}})
            bad = client.post("/v1/chat/completions", json={"model": QWEN, "messages": []})
            for _ in range(3):
                client.post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "max_tokens": 4})
            limited = client.post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO})
        unauthorized = httpx.post(gw.url + "/v1/chat/completions", json={"model": QWEN, "messages": HELLO},
                                  headers={"Authorization": "Bearer sk-kiln-wrong"})
        assert (ok.status_code, streamed.status_code, messages.status_code, failed.status_code, bad.status_code,
                limited.status_code, unauthorized.status_code) == (200, 200, 200, 502, 400, 429, 401)

        m = scrape(port)
        chat = {"endpoint": "chat.completions", "model": QWEN}
        assert total(m, "kiln_requests_total", **chat, status_class="2xx", error_type="none") == 4 + 1
        assert total(m, "kiln_requests_total", **chat, status_class="5xx", error_type="backend") == 1
        assert total(m, "kiln_requests_total", endpoint="chat.completions", error_type="invalid_request") == 1
        assert total(m, "kiln_requests_total", **chat, status_class="4xx", error_type="rate_limited") == 1
        assert total(m, "kiln_requests_total", endpoint="chat.completions", error_type="unauthorized") == 1
        assert total(m, "kiln_requests_total", endpoint="messages", status_class="2xx") == 1
        assert total(m, "kiln_admission_refusals_total", reason="requests_per_minute") == 1
        assert total(m, "kiln_keepalives_sent_total", endpoint="chat.completions") >= 1
        assert total(m, "kiln_tokens_total", model=QWEN, type="input") > 0
        assert total(m, "kiln_tokens_total", model=QWEN, type="output") > 0
        assert total(m, "kiln_cost_usd_total", model=QWEN) > 0
        assert total(m, "gen_ai_server_time_to_first_token_seconds_count") == 1  # the stream
        assert total(m, "kiln_gateway_overhead_seconds_count") >= 5
        waited = time.monotonic() + 5  # journaled events commit within ledger_linger_s (0.1 s)
        while total(m, "kiln_ledger_events_committed_total") < 6 and time.monotonic() < waited:
            time.sleep(0.05)
            m = scrape(port)
        assert total(m, "kiln_ledger_events_committed_total") >= 6
        assert total(m, "kiln_backend_state", model=QWEN, state="healthy") == 1
        assert total(m, "kiln_backend_in_flight", model=QWEN) == 0  # every lease released

        def logged() -> list[dict[str, Any]] | None:
            lines = access_lines(gw.log.read_text())
            return lines if len(lines) >= 10 else None

        lines = wait_for(logged, timeout=10, what="an access line per request")
        assert len(lines) == 10
        by_id = {line["generation_id"]: line for line in lines if line["generation_id"]}
        for resp in (ok, streamed, messages, failed):
            line = by_id[resp.headers["x-neocloud-generation-id"]]
            assert line["key_id"] == tenant.key_id and line["org_id"] == tenant.org_id
        assert by_id[ok.headers["x-neocloud-generation-id"]]["status"] == 200
        assert by_id[failed.headers["x-neocloud-generation-id"]]["error"] == "backend"
        assert by_id[streamed.headers["x-neocloud-generation-id"]]["ttft_ms"] > 0
        assert {line["status"] for line in lines if not line["generation_id"]} == {400, 401, 429}
        assert tenant.key not in gw.log.read_text()  # never a secret in the log
    finally:
        stop(gw.proc)


@pytest.mark.parametrize("fmt", ["text"])
def test_text_access_lines_when_asked(sim: Sim, fmt: str) -> None:
    gw = start_gateway(catalog_toml(sim.url) + f'\n[log]\nformat = "{fmt}"\n')
    try:
        tenant = gw.new_key()
        r = tenant.http().post("/v1/chat/completions", json={"model": QWEN, "messages": HELLO, "max_tokens": 4})
        gen_id = r.headers["x-neocloud-generation-id"]
        line = wait_for(lambda: next((ln for ln in gw.log.read_text().splitlines() if gen_id in ln), None),
                        what="the access line")
        assert f"generation_id={gen_id}" in line and "status=200" in line and not line.startswith("{")
    finally:
        stop(gw.proc)

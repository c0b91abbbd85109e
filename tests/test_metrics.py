"""Prometheus metrics (kiln/metrics.py): what the recording functions count, read back through
prometheus-client's own parser, and GET /metrics on a real gateway, on its main port (admin
credential) and on a port of its own (none).

These tests call the recording functions directly; tests/test_observability.py checks what
the request path feeds them.
"""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ADMIN_KEY, Gateway, Sim, Tenant, catalog_toml, free_port, start_gateway, stop
from kiln import metrics

FAMILIES = {
    "kiln_requests", "kiln_tokens", "kiln_cost_usd", "kiln_org_tokens", "kiln_org_cost_usd",
    "gen_ai_client_token_usage", "gen_ai_client_operation_duration_seconds",
    "gen_ai_server_time_to_first_token_seconds", "gen_ai_server_time_per_output_token_seconds",
    "kiln_gateway_overhead_seconds", "kiln_admission_refusals",
    "kiln_keepalives_sent", "kiln_ledger_commit_seconds", "kiln_ledger_events_committed",
}
GATEWAY_FAMILIES = {"kiln_requests_in_flight", "kiln_ledger_queue_depth", "kiln_maintenance", "kiln_backend_up",
                    "kiln_backend_state", "kiln_backend_in_flight", "kiln_backend_failures"}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset(labels.items()))]


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This test's own counts, and the catalog of the session's gateway as the known models."""
    monkeypatch.setattr(metrics, "COUNTS", metrics.Counts())
    metrics.configure(["qwen3-32b", "gpt-oss-120b"], org_label=False)
    yield
    metrics.configure([], org_label=False)


def test_a_request_is_counted_in_every_family(fresh: None) -> None:
    for _ in range(2):
        metrics.record_request("chat.completions", "qwen3-32b", 200, duration_s=1.5, overhead_s=0.0007,
                               ttft_s=0.3, prompt_tokens=100, cached_tokens=40, completion_tokens=13,
                               reasoning_tokens=5, cost_nano=1_234_567, org_id="org_a")
    text = metrics.render().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert FAMILIES <= names and "process_cpu_seconds" in names
    labels = {"endpoint": "chat.completions", "model": "qwen3-32b", "status_class": "2xx", "error_type": "none"}
    assert value(text, "kiln_requests_total", **labels) == 2
    for kind, n in (("input", 200), ("cached_input", 80), ("output", 26), ("reasoning", 10)):
        assert value(text, "kiln_tokens_total", model="qwen3-32b", type=kind) == n
    assert value(text, "kiln_cost_usd_total", model="qwen3-32b") == pytest.approx(0.002469134)
    genai = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "qwen3-32b"}
    duration = "gen_ai_client_operation_duration_seconds"
    assert value(text, duration + "_count", **genai, error_type="none") == 2
    assert value(text, duration + "_sum", **genai, error_type="none") == pytest.approx(3.0)
    assert value(text, duration + "_bucket", **genai, error_type="none", le="1.28") == 0  # cumulative `le`
    assert value(text, duration + "_bucket", **genai, error_type="none", le="2.56") == 2
    assert value(text, duration + "_bucket", **genai, error_type="none", le="+Inf") == 2
    assert value(text, "gen_ai_server_time_to_first_token_seconds_bucket", **genai, le="0.25") == 0
    assert value(text, "gen_ai_server_time_to_first_token_seconds_bucket", **genai, le="0.5") == 2
    # (1.5 s - 0.3 s) over the 12 tokens after the first: 0.1 s each
    assert value(text, "gen_ai_server_time_per_output_token_seconds_sum", **genai) == pytest.approx(0.2)
    assert value(text, "gen_ai_client_token_usage_sum", **genai, gen_ai_token_type="input") == 200
    assert value(text, "gen_ai_client_token_usage_sum", **genai, gen_ai_token_type="output") == 26
    assert value(text, "kiln_gateway_overhead_seconds_bucket", endpoint="chat.completions", le="0.001") == 2
    assert not [s for s in samples(text) if s[0].startswith("kiln_org_")]  # org labels are off by default


def test_labels_come_from_closed_sets(fresh: None) -> None:
    metrics.record_request("messages", "a-model-nobody-serves", 429, metrics.error_type(429), duration_s=0.001)
    metrics.record_request("/v1/anything", None, 502, "whatever", duration_s=0.2)
    metrics.record_request("responses", "gpt-oss-120b", 503, metrics.error_type(503, from_backend=True),
                           duration_s=0.05)
    metrics.record_refusal("credits")
    metrics.record_refusal("made-up reason")
    text = metrics.render().decode()
    requests = {dict(labels)["model"] + "|" + dict(labels)["endpoint"] + "|" + dict(labels)["error_type"]
                + "|" + dict(labels)["status_class"]: v
                for (name, labels), v in samples(text).items() if name == "kiln_requests_total"}
    assert requests == {"unknown|messages|rate_limited|4xx": 1, "unknown|other|other|5xx": 1,
                        "gpt-oss-120b|responses|backend|5xx": 1}
    assert value(text, "kiln_admission_refusals_total", reason="credits") == 1
    assert value(text, "kiln_admission_refusals_total", reason="other") == 1
    assert [metrics.error_type(s) for s in (200, 400, 401, 402, 403, 404, 429, 499, 500, 502, 503, 504, 418)] == [
        "none", "invalid_request", "unauthorized", "payment_required", "forbidden", "invalid_request",
        "rate_limited", "cancelled", "internal", "backend", "unavailable", "timeout", "other"]
    assert set(metrics.ERROR_TYPES) >= {metrics.error_type(s) for s in range(100, 600)}


def test_organisation_labels_keepalives_and_the_ledger(fresh: None) -> None:
    metrics.configure(["qwen3-32b"], org_label=True)
    metrics.record_request("completions", "qwen3-32b", 200, duration_s=0.4, prompt_tokens=7, completion_tokens=3,
                           cost_nano=2_000, org_id="org_b")
    metrics.record_keepalive("messages")
    metrics.record_ledger_commit(0.003, 12)
    text = metrics.render().decode()
    assert value(text, "kiln_org_tokens_total", org="org_b", type="input") == 7
    assert value(text, "kiln_org_cost_usd_total", org="org_b") == pytest.approx(2e-6)
    assert value(text, "kiln_keepalives_sent_total", endpoint="messages") == 1
    assert value(text, "kiln_ledger_commit_seconds_bucket", le="0.0025") == 0
    assert value(text, "kiln_ledger_commit_seconds_bucket", le="0.005") == 1
    assert value(text, "kiln_ledger_events_committed_total") == 12


# -- GET /metrics on a running gateway ----------------------------------------------------------


def test_metrics_on_the_main_port_need_the_admin_credential(gateway: Gateway, tenant: Tenant) -> None:
    anonymous = httpx.get(gateway.url + "/metrics", timeout=30)
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
    assert anonymous.json()["error"]["type"] == "authentication_error"
    as_tenant = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {tenant.key}"}, timeout=30)
    assert as_tenant.status_code == 401
    r = httpx.get(gateway.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    om = httpx.get(gateway.url + "/metrics", timeout=30, headers={
        "Authorization": f"Bearer {ADMIN_KEY}", "Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text") and om.text.endswith("# EOF\n")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert FAMILIES | GATEWAY_FAMILIES <= names
    assert value(r.text, "kiln_requests_in_flight") == 0
    assert value(r.text, "kiln_maintenance") == 0
    up = {dict(labels)["model"]: v for (name, labels), v in samples(r.text).items() if name == "kiln_backend_up"}
    assert up == {"qwen3-32b": 1, "gpt-oss-120b": 1, "offline-model": 0}
    offline = {dict(labels)["state"]: v for (name, labels), v in samples(r.text).items()
               if name == "kiln_backend_state" and dict(labels)["model"] == "offline-model"}
    assert offline == {"healthy": 0, "ejected": 0, "down": 1}


def test_metrics_on_their_own_port_need_no_credential(sim: Sim) -> None:
    port = free_port()
    gw = start_gateway(catalog_toml(sim.url, extra="") + f"\n[metrics]\nport = {port}\n")
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30)
        assert r.status_code == 200
        names = {f.name for f in text_string_to_metric_families(r.text)}
        assert FAMILIES | GATEWAY_FAMILIES <= names
        assert httpx.get(gw.url + "/metrics", timeout=30).status_code == 401  # the main port still asks
        # maintenance, read from the gateway when scraped
        assert gw.admin.put("/maintenance", json={"until": "2099-01-01T00:00:00Z"}).status_code == 200
        assert value(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text, "kiln_maintenance") == 1
    finally:
        stop(gw.proc)
    with pytest.raises(httpx.HTTPError):  # it stops with the gateway
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)

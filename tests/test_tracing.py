"""OpenTelemetry traces through a real gateway into a real OTLP/HTTP receiver.

The receiver is a small HTTP server in this test that decodes what the
gateway's exporter posts (protobuf, OTLP's own message types). Checked: one
server span and one client span per request, the client's trace continued,
GenAI attributes, and the client span's `traceparent` reaching the backend.
With tracing off, the client's own `traceparent` still reaches the backend.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Iterator

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from conftest import HELLO, QWEN, Gateway, Sim, catalog_toml, free_port, new_tag, start_gateway, stop, wait_for

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


class Receiver:
    """Collects the spans of every export posted to it."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server API)
                body = self.rfile.read(int(self.headers["content-length"]))
                export = ExportTraceServiceRequest()
                export.ParseFromString(body)
                for resource in export.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = v.string_value or v.int_value or ([x.string_value for x in v.array_value.values]
                                                        if v.HasField("array_value") else v.bool_value)
    return out


@pytest.fixture(scope="module")
def traced(sim: Sim) -> Iterator[tuple[Gateway, Receiver]]:
    receiver = Receiver()
    gw = start_gateway(catalog_toml(sim.url) + f'\n[tracing]\nendpoint = "{receiver.url}"\n')
    yield gw, receiver
    stop(gw.proc)
    receiver.server.shutdown()


def test_a_request_is_one_server_span_with_a_client_span_for_the_backend(traced: tuple[Gateway, Receiver],
                                                                        sim: Sim) -> None:
    gw, receiver = traced
    tenant = gw.new_key()
    tag = new_tag()
    r = tenant.http().post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                           json={"model": QWEN, "messages": HELLO, "max_tokens": 5, "sim": {"tag": tag}})
    assert r.status_code == 200
    gen_id = r.headers["x-neocloud-generation-id"]

    def mine() -> list[Any] | None:
        spans = [s for s in receiver.spans if s.trace_id.hex() == CLIENT_TRACE]
        return spans if len(spans) >= 2 else None

    spans = wait_for(mine, timeout=15, what="the request's spans at the collector")  # the SDK exports in batches
    server = next(s for s in spans if s.name == "POST /v1/chat/completions")
    client = next(s for s in spans if s.name == f"chat {QWEN}")
    assert server.parent_span_id.hex() == "00f067aa0ba902b7"  # the client's trace, continued
    assert client.parent_span_id == server.span_id
    attrs = attributes(client)
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == QWEN
    assert attrs["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"]
    assert attrs["gen_ai.response.id"] == gen_id and attrs["gen_ai.response.finish_reasons"] == ["length"]
    headers = next(e["headers"] for e in reversed(sim.requests()) if (e["body"].get("sim") or {}).get("tag") == tag)
    sent = {k.lower(): v for k, v in headers.items()}["traceparent"]
    assert sent.split("-")[1] == CLIENT_TRACE and sent.split("-")[2] == client.span_id.hex()


def test_a_refused_request_is_a_span_with_its_error(traced: tuple[Gateway, Receiver]) -> None:
    gw, receiver = traced
    trace_id = "aa" * 16
    r = gw.http("sk-kiln-not-a-key").post("/v1/messages", headers={"traceparent": f"00-{trace_id}-{'bb' * 8}-01"},
                                          json={"model": QWEN, "max_tokens": 5, "messages": HELLO})
    assert r.status_code == 401
    span = wait_for(lambda: next((s for s in receiver.spans if s.trace_id.hex() == trace_id), None), timeout=15,
                    what="the refused request's span")
    assert attributes(span)["error.type"] == "unauthorized" and attributes(span)["http.response.status_code"] == 401


def test_without_tracing_the_clients_traceparent_still_reaches_the_backend(gateway: Gateway, sim: Sim) -> None:
    tenant = gateway.new_key()
    tag = new_tag()
    tenant.http().post("/v1/chat/completions", headers={"traceparent": TRACEPARENT, "tracestate": "k=v"},
                       json={"model": QWEN, "messages": HELLO, "max_tokens": 2, "sim": {"tag": tag}})
    headers = next(e["headers"] for e in reversed(sim.requests()) if (e["body"].get("sim") or {}).get("tag") == tag)
    sent = {k.lower(): v for k, v in headers.items()}
    assert sent["traceparent"] == TRACEPARENT and sent["tracestate"] == "k=v"

"""OpenTelemetry traces: one server span per request and one client span for its backend call.

Off unless `[tracing] endpoint` names an OTLP/HTTP collector; the SDK is an
optional extra (`pip install 'kiln-gateway[tracing]'`) and is imported only
then, so a gateway without tracing pays one attribute check per request.
Spans carry OpenTelemetry's GenAI semantic-convention attributes
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.usage.*`,
`gen_ai.response.finish_reasons`, ...) and are exported in batches by the
SDK's own thread, off the event loop.

The W3C `traceparent` reaches the backend either way: with tracing on, the
client span's (a child of the client's own trace, when it sent one); with
tracing off, the client's header unchanged, so a traced client and a traced
model server still see one trace through the gateway.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from kiln.config import TracingSettings
from kiln.core.records import UsageEvent

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("kiln.tracing")

# OpenTelemetry's gen_ai.operation.name for each endpoint.
OPERATIONS = {"chat.completions": "chat", "completions": "text_completion", "responses": "chat", "messages": "chat",
              "messages.count_tokens": "count_tokens"}
_PROPAGATED = ("traceparent", "tracestate")

_tracer: Tracer | None = None
_provider: Any = None


@dataclass(slots=True)
class Trace:
    """One request's spans (None when tracing is off) and the trace headers for its backend."""

    server: Span | None = None
    client: Span | None = None
    incoming: dict[str, str] | None = None  # the client's trace headers, forwarded when tracing is off
    operation: str = "chat"


def configure(settings: TracingSettings) -> None:
    """Start exporting when an endpoint is set; a missing SDK is a clear error at start."""
    global _tracer, _provider
    if settings.endpoint is None:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise RuntimeError("[tracing] endpoint is set but the OpenTelemetry SDK is not installed: "
                           "pip install 'kiln-gateway[tracing]'") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint)))
    _provider, _tracer = provider, provider.get_tracer("kiln")
    log.info("exporting traces to %s", settings.endpoint)


def shutdown() -> None:
    """Flush what is buffered; the gateway is stopping."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def begin(headers: Mapping[str, str], endpoint: str) -> Trace:
    """The request's server span, a child of the client's trace if it sent one."""
    incoming = {k: headers[k] for k in _PROPAGATED if k in headers} or None
    if _tracer is None:
        return Trace(incoming=incoming)
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    operation = OPERATIONS.get(endpoint, endpoint)
    span = _tracer.start_span(f"POST /v1/{endpoint.replace('.', '/')}", kind=SpanKind.SERVER,
                              context=extract(incoming) if incoming else None,
                              attributes={"gen_ai.operation.name": operation})
    return Trace(server=span, operation=operation)


def backend_headers(trace: Trace, model: str, backend_url: str) -> dict[str, str] | None:
    """Start the backend call's client span; the trace headers that go to the backend."""
    if trace.server is None:
        return trace.incoming
    from opentelemetry.propagate import inject
    from opentelemetry.trace import SpanKind, set_span_in_context

    assert _tracer is not None
    if trace.client is not None:  # a failover: the earlier attempt's span ends here
        trace.client.end()
    operation = trace.operation
    trace.client = _tracer.start_span(f"{operation} {model}", kind=SpanKind.CLIENT,
                                      context=set_span_in_context(trace.server),
                                      attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                                                  "server.address": backend_url, "gen_ai.provider.name": "openai"})
    carrier: dict[str, str] = {}
    inject(carrier, context=set_span_in_context(trace.client))
    return carrier


def end(trace: Trace, model: str | None, status: int, error: str, event: UsageEvent | None) -> None:
    """End both spans with what the request came to."""
    if trace.server is None:
        return
    from opentelemetry.trace import Status, StatusCode

    attributes: dict[str, Any] = {"http.response.status_code": status}
    if model:
        attributes["gen_ai.request.model"] = model
    if event is not None:
        attributes.update({
            "gen_ai.response.id": event.id, "gen_ai.usage.input_tokens": event.prompt_tokens,
            "gen_ai.usage.output_tokens": event.completion_tokens, "kiln.cost_usd_nano": event.cost_nano,
            "kiln.generation_id": event.id, "kiln.org_id": event.org_id,
        })
        if event.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [event.finish_reason]
    for span in (trace.client, trace.server):
        if span is None:
            continue
        span.set_attributes(attributes)
        if error != "none":
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

"""Prometheus metrics: what the gateway served, what it cost, how fast, and why it refused.

The request path calls `record_request` once per request (and `record_refusal`,
`record_keepalive`, `record_ledger_commit` where those
happen). A call adds to plain Python numbers kept per label set: one dictionary lookup and
a few bisects, no lock (the event loop is one thread). prometheus-client turns them into
its metric families only when scraped, and writes the exposition (text or OpenMetrics).
Its own Counter and Histogram objects cost ~1.6 µs per histogram observation (a lock per
bucket add): some 20 µs a request here, against ~3 µs this way (README, "Metrics").

What is true at any moment (requests in flight, backend health, ledger queue depth,
maintenance) is read from the gateway at scrape time, costing the hot path nothing.

Every label takes values from a closed set (endpoints, catalog models, status classes,
error types, refusal reasons), so no client can make new series. The GenAI histograms
carry OpenTelemetry's semantic-convention names as its Prometheus exporter writes them
(`gen_ai.client.operation.duration`, seconds -> gen_ai_client_operation_duration_seconds)
and its advised buckets, widened for long generations.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.access_log import safe_url
from kiln.core import errors
from kiln.core.keys import bearer_token
from kiln.protocols.openai.errors import openai_error

# -- the closed label sets --------------------------------------------------------------------

# Each endpoint and OpenTelemetry's gen_ai.operation.name for it.
OPERATIONS = {"chat.completions": "chat", "completions": "text_completion", "responses": "chat",
              "messages": "chat", "messages.count_tokens": "count_tokens"}
# Why a request failed. The gateway's own refusals (unauthorized ... unavailable) are told
# apart from the model server's failures ("backend"), whatever HTTP status those map to.
ERROR_TYPES = ("none", "invalid_request", "unauthorized", "payment_required", "forbidden", "rate_limited",
               "unavailable", "timeout", "cancelled", "backend", "internal", "other")
_BY_STATUS = {400: "invalid_request", 404: "invalid_request", 405: "invalid_request", 413: "invalid_request",
              422: "invalid_request", 401: "unauthorized", 402: "payment_required", 403: "forbidden",
              429: "rate_limited", 503: "unavailable", 504: "timeout", 499: "cancelled", 502: "backend",
              500: "internal"}
REFUSAL_REASONS = ("concurrency", "requests_per_minute", "tokens_per_minute", "token_counts_per_minute",
                   "credits", "budget", "key_spend_limit", "maintenance", "other")
UNKNOWN = "unknown"  # a model name that is not in the catalog, or none
TOKEN_TYPES = ("input", "cached_input", "output", "reasoning")  # input includes cached_input

# LLM-sized buckets (seconds or tokens): OpenTelemetry's advice for GenAI, widened where generations run long.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
                    163.84, 327.68, 655.36)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# -- what the hot path adds to ------------------------------------------------------------------


@dataclass(slots=True)
class Hist:
    """A histogram's bucket counts (the last one past every bound) and sum, not cumulative."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value: Prometheus's `le`
        self.total += value

    def add(self, other: "Hist") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total


@dataclass(slots=True)
class Series:
    """Everything counted for one (endpoint, model, status class, error type)."""

    requests: int = 0
    duration: Hist = field(default_factory=lambda: Hist(DURATION_BUCKETS))
    overhead: Hist = field(default_factory=lambda: Hist(OVERHEAD_BUCKETS))
    ttft: Hist = field(default_factory=lambda: Hist(TTFT_BUCKETS))
    tpot: Hist = field(default_factory=lambda: Hist(TPOT_BUCKETS))
    input_usage: Hist = field(default_factory=lambda: Hist(TOKEN_BUCKETS))
    output_usage: Hist = field(default_factory=lambda: Hist(TOKEN_BUCKETS))
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # TOKEN_TYPES order
    cost_nano: int = 0  # exact; USD only when scraped


@dataclass
class Counts:
    """All the gateway counted since it started (one per process)."""

    series: dict[tuple[str, str, str, str], Series] = field(default_factory=dict)
    orgs: dict[str, list[int]] = field(default_factory=dict)  # org -> TOKEN_TYPES counts + cost_nano
    refusals: dict[str, int] = field(default_factory=dict)
    keepalives: dict[str, int] = field(default_factory=dict)
    ledger_commit: Hist = field(default_factory=lambda: Hist(COMMIT_BUCKETS))
    ledger_events: int = 0


COUNTS = Counts()
_models: frozenset[str] = frozenset()
_org_label = False


def configure(models: Iterable[str], org_label: bool = False) -> None:
    """The catalog's model ids (any other name counts as 'unknown') and whether to count
    tokens and cost per organisation too (one series per organisation: mind the cardinality)."""
    global _models, _org_label
    _models, _org_label = frozenset(models), org_label


def error_type(status: int, from_backend: bool = False) -> str:
    """The error-type label of a response status; `from_backend` for a model server's failure."""
    if status < 400:
        return "none"
    if from_backend and status >= 500:  # a 4xx the backend gave is still the request's fault
        return "backend"
    return _BY_STATUS.get(status, "other")


def record_request(
    endpoint: str,
    model: str | None,
    status: int,
    error: str = "none",
    *,
    duration_s: float,
    overhead_s: float | None = None,
    ttft_s: float | None = None,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    completion_tokens: int = 0,
    reasoning_tokens: int = 0,
    cost_nano: int = 0,
    org_id: str | None = None,
) -> None:
    """Count one finished request: call once, when its usage is known (or it was refused)."""
    key = (endpoint if endpoint in OPERATIONS else "other", model if model in _models else UNKNOWN,
           _STATUS_CLASSES[status // 100] if 0 < status < 600 else "other",
           error if error in _ERRORS else "other")
    s = COUNTS.series.get(key)
    if s is None:
        s = COUNTS.series[key] = Series()
    s.requests += 1
    s.duration.observe(duration_s)
    if overhead_s is not None:
        s.overhead.observe(overhead_s)
    if ttft_s is not None:
        s.ttft.observe(ttft_s)
        if completion_tokens > 1:
            s.tpot.observe(max(duration_s - ttft_s, 0.0) / (completion_tokens - 1))
    if prompt_tokens or completion_tokens:
        s.input_usage.observe(prompt_tokens)
        s.output_usage.observe(completion_tokens)
        t = s.tokens
        t[0] += prompt_tokens
        t[1] += cached_tokens
        t[2] += completion_tokens
        t[3] += reasoning_tokens
    s.cost_nano += cost_nano
    if _org_label and org_id and (prompt_tokens or completion_tokens or cost_nano):
        o = COUNTS.orgs.get(org_id)
        if o is None:
            o = COUNTS.orgs[org_id] = [0, 0, 0, 0, 0]
        o[0] += prompt_tokens
        o[1] += cached_tokens
        o[2] += completion_tokens
        o[3] += reasoning_tokens
        o[4] += cost_nano


_STATUS_CLASSES = ("other", "1xx", "2xx", "3xx", "4xx", "5xx")
_ERRORS = frozenset(ERROR_TYPES)


def record_refusal(reason: str) -> None:
    """Admission refused a request (429, 402, or 503 in maintenance)."""
    reason = reason if reason in REFUSAL_REASONS else "other"
    COUNTS.refusals[reason] = COUNTS.refusals.get(reason, 0) + 1


def record_keepalive(endpoint: str) -> None:
    endpoint = endpoint if endpoint in OPERATIONS else "other"
    COUNTS.keepalives[endpoint] = COUNTS.keepalives.get(endpoint, 0) + 1


def record_ledger_commit(seconds: float, events: int) -> None:
    COUNTS.ledger_commit.observe(seconds)
    COUNTS.ledger_events += events


# -- read when scraped --------------------------------------------------------------------------


def _histogram(name: str, doc: str, labels: tuple[str, ...], hists: dict[tuple[str, ...], Hist]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for values, h in sorted(hists.items()):
        cumulative, running = [], 0
        for bound, n in zip((*h.bounds, float("inf")), h.counts):
            running += n
            cumulative.append((_bound(bound), running))
        family.add_metric(list(values), cumulative, h.total)
    return family


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _merged(pick: Callable[[Series], Hist], label: Callable[[tuple[str, str, str, str]], tuple[str, ...]],
            bounds: tuple[float, ...]) -> dict[tuple[str, ...], Hist]:
    """One histogram per label set, adding up the series that share it."""
    out: dict[tuple[str, ...], Hist] = {}
    for key, s in list(COUNTS.series.items()):
        h = pick(s)
        if sum(h.counts):
            out.setdefault(label(key), Hist(bounds)).add(h)
    return out


def _request_families() -> Iterator[Metric]:
    series = list(COUNTS.series.items())
    requests = CounterMetricFamily("kiln_requests", "Requests by endpoint, model, status class and error type.",
                                   labels=("endpoint", "model", "status_class", "error_type"))
    tokens = CounterMetricFamily("kiln_tokens", "Tokens billed by model and type (input includes cached_input).",
                                 labels=("model", "type"))
    cost = CounterMetricFamily("kiln_cost_usd", "Cost billed in USD by model (the ledger holds the exact amounts).",
                               labels=("model",))
    by_model: dict[str, list[int]] = {}
    for key, s in sorted(series):
        requests.add_metric(list(key), s.requests)
        totals = by_model.setdefault(key[1], [0, 0, 0, 0, 0])
        for i, n in enumerate((*s.tokens, s.cost_nano)):
            totals[i] += n
    for model, totals in sorted(by_model.items()):
        for kind, n in zip(TOKEN_TYPES, totals):
            tokens.add_metric([model, kind], n)
        cost.add_metric([model], totals[4] / 1e9)
    yield from (requests, tokens, cost)
    genai = ("gen_ai_operation_name", "gen_ai_request_model")

    def op_model(k: tuple[str, str, str, str]) -> tuple[str, ...]:
        return OPERATIONS.get(k[0], k[0]), k[1]

    yield _histogram("gen_ai_client_operation_duration_seconds",
                     "Whole request duration as the client sees it (OpenTelemetry GenAI).", (*genai, "error_type"),
                     _merged(lambda s: s.duration, lambda k: (*op_model(k), k[3]), DURATION_BUCKETS))
    yield _histogram("gen_ai_server_time_to_first_token_seconds",
                     "Time to the first content of a stream (OpenTelemetry GenAI).", genai,
                     _merged(lambda s: s.ttft, op_model, TTFT_BUCKETS))
    yield _histogram("gen_ai_server_time_per_output_token_seconds",
                     "Time per output token after the first, streams only (OpenTelemetry GenAI).", genai,
                     _merged(lambda s: s.tpot, op_model, TPOT_BUCKETS))
    usage = {(*k, "input"): h for k, h in _merged(lambda s: s.input_usage, op_model, TOKEN_BUCKETS).items()}
    usage.update({(*k, "output"): h for k, h in _merged(lambda s: s.output_usage, op_model, TOKEN_BUCKETS).items()})
    yield _histogram("gen_ai_client_token_usage", "Input and output tokens per request (OpenTelemetry GenAI).",
                     (*genai, "gen_ai_token_type"), usage)
    yield _histogram("kiln_gateway_overhead_seconds",
                     "Time spent in Kiln itself for a request, the backend's time excluded.", ("endpoint",),
                     _merged(lambda s: s.overhead, lambda k: (k[0],), OVERHEAD_BUCKETS))


def _other_families() -> Iterator[Metric]:
    org_tokens = CounterMetricFamily("kiln_org_tokens", "Tokens billed by organisation and type "
                                     "([metrics] org_label).", labels=("org", "type"))
    org_cost = CounterMetricFamily("kiln_org_cost_usd", "Cost billed in USD by organisation ([metrics] org_label).",
                                   labels=("org",))
    for org, counts in sorted(COUNTS.orgs.items()):
        for kind, n in zip(TOKEN_TYPES, counts):
            org_tokens.add_metric([org, kind], n)
        org_cost.add_metric([org], counts[4] / 1e9)
    yield from (org_tokens, org_cost)
    for name, doc, label, values, kind in (
        ("kiln_admission_refusals", "Requests admission refused, by reason.", "reason", COUNTS.refusals,
         CounterMetricFamily),
        ("kiln_keepalives_sent", "Keepalive frames sent on streams while a backend was silent.", "endpoint",
         COUNTS.keepalives, CounterMetricFamily),
    ):
        family = kind(name, doc, labels=(label,))
        for value, n in sorted(dict(values).items()):
            family.add_metric([value], n)
        yield family
    yield _histogram("kiln_ledger_commit_seconds", "Time of one usage-ledger commit (a batch of events).", (),
                     {(): COUNTS.ledger_commit})
    yield CounterMetricFamily("kiln_ledger_events_committed", "Usage events committed to the ledger.",
                              value=COUNTS.ledger_events)


def _gateway_families(gw: Any) -> Iterator[Metric]:
    yield GaugeMetricFamily("kiln_requests_in_flight", "Metered requests in flight.", value=gw.in_flight)
    yield GaugeMetricFamily("kiln_ledger_queue_depth", "Usage events waiting for a ledger commit.",
                            value=gw.ledger.depth)
    yield GaugeMetricFamily("kiln_maintenance", "1 while the gateway is in maintenance.",
                            value=int(gw.maintenance.active))
    up = GaugeMetricFamily("kiln_backend_up", "1 while the backend takes traffic (healthy), else 0.",
                           labels=("model", "backend"))
    state = GaugeMetricFamily("kiln_backend_state", "1 for the backend's state: healthy, ejected or down.",
                              labels=("model", "backend", "state"))
    in_flight = GaugeMetricFamily("kiln_backend_in_flight", "Requests in flight to each backend.",
                                  labels=("model", "backend"))
    failures = GaugeMetricFamily("kiln_backend_failures", "Failed requests in a row.", labels=("model", "backend"))
    for model in gw.catalog.models:
        for b in model.backends:
            labels = [model.id, safe_url(b.url) or b.url]
            up.add_metric(labels, int(b.state.status == "healthy"))
            for name in ("healthy", "ejected", "down"):
                state.add_metric([*labels, name], int(b.state.status == name))
            in_flight.add_metric(labels, b.state.in_flight)
            failures.add_metric(labels, b.state.failures)
    yield from (up, state, in_flight, failures)


class _Kiln(Collector):
    """What prometheus-client asks for at each scrape."""

    gateway: Any = None

    def collect(self) -> Iterator[Metric]:
        yield from _request_families()
        yield from _other_families()
        if self.gateway is not None:
            yield from _gateway_families(self.gateway)


_COLLECTOR = _Kiln()
REGISTRY = CollectorRegistry(auto_describe=False)  # Kiln's own: the process's and Kiln's metrics only
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)
REGISTRY.register(_COLLECTOR)


def bind(gateway: Any) -> None:
    """Read this gateway's state when scraped; its catalog's model ids become the model labels."""
    _COLLECTOR.gateway = gateway
    configure((m.id for m in gateway.catalog.models), gateway.settings.metrics.org_label)


def render() -> bytes:
    """The Prometheus text exposition of every metric."""
    return generate_latest(REGISTRY)


def serve(host: str, port: int) -> Callable[[], None]:
    """Serve the metrics on a port of their own (a thread, no credential); returns the stop function."""
    server, thread = start_http_server(port, host, registry=REGISTRY)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop


async def endpoint(request: Request) -> Response:
    """GET /metrics on the main port: the admin credential is required there, because that port
    faces tenants and the metrics name models, organisations and spend ([metrics] port serves
    them with no credential, for a Prometheus on a private network)."""
    gw = request.app.state.gateway
    token, _ = bearer_token(request.headers.get("authorization"), None)
    if token is None or not gw.accounts.is_admin(token):
        reply = openai_error(errors.unauthorized(
            "GET /metrics on this port needs the admin credential (Authorization: Bearer <admin key>); "
            "[metrics] port serves it without one."))
        return Response(reply.body, status_code=reply.status, media_type=reply.media_type,
                        headers={"WWW-Authenticate": "Bearer"})
    encode, content_type = choose_encoder(request.headers.get("accept", ""))  # OpenMetrics if asked for
    return Response(encode(REGISTRY), headers={"Content-Type": content_type})


routes = [Route("/metrics", endpoint, methods=["GET"])]

"""What an operator sees of one request once it is over: its metrics, its access-log line, its spans.

Called once per request by the pipeline, never per chunk. `finished` is for
a request admission let in (its usage event, if one was recorded, gives the
tokens, cost and time to first token); `refused` for one stopped before.
"""

from __future__ import annotations

import time

from kiln import access_log, metrics, tracing
from kiln.core.errors import GatewayError
from kiln.core.records import ApiKey, UsageEvent


def finished(endpoint: str, model: str, status: int, error: str, *, started: float, key: ApiKey,
             event: UsageEvent | None, backend_url: str | None, backend_s: float, trace: tracing.Trace) -> None:
    tracing.end(trace, model, status, error, event)
    duration = time.monotonic() - started
    if event is None:
        metrics.record_request(endpoint, model, status, error, duration_s=duration)
    else:
        metrics.record_request(
            endpoint, model, status, error, duration_s=duration,
            overhead_s=max(duration - backend_s, 0.0),  # the gateway's own time: all but the backend's
            ttft_s=None if event.ttft_ms is None else event.ttft_ms / 1000,
            prompt_tokens=event.prompt_tokens, cached_tokens=event.cached_tokens,
            completion_tokens=event.completion_tokens, reasoning_tokens=event.reasoning_tokens,
            cost_nano=event.cost_nano, org_id=event.org_id,
        )
    access_log.log_request(status=status, endpoint=endpoint, duration_ms=duration * 1000, event=event, key=key,
                           model=model, backend=backend_url, error=None if error == "none" else error)


def refused(endpoint: str, err: GatewayError, *, started: float, key: ApiKey | None, model: str | None,
            trace: tracing.Trace) -> None:
    duration = time.monotonic() - started
    error = metrics.error_type(err.status, err.backend)
    tracing.end(trace, model, err.status, error, None)
    metrics.record_request(endpoint, model, err.status, error, duration_s=duration)
    if err.reason is not None:
        metrics.record_refusal(err.reason)
    access_log.log_request(status=err.status, endpoint=endpoint, duration_ms=duration * 1000, key=key,
                           model=model, error=error)

"""One admitted request as the steps after admission see it, and the usage it is billed for.

The pipeline (kiln/pipeline.py) carries an `Admitted` from the backend call to the answer; the
functions here are the billing rule every outcome shares: the backend's own usage when it lies
within what the request could have used (nothing from a backend is trusted without a bound),
else an estimate, marked inexact: the prompt counted by the backend's tokenizer, the output by
the pieces that reached the client.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kiln import backends, tracing
from kiln.catalog import Backend
from kiln.core.admission import Ticket
from kiln.core.records import ApiKey, Usage, UsageEvent
from kiln.health import Outcome
from kiln.protocols.base import Translator, UpstreamCall
from kiln.router import Lease
from kiln.upstream import Upstream

log = logging.getLogger("kiln.pipeline")  # its warnings kept the logger they had in the pipeline


@dataclass
class Admitted:
    """One admitted request, as the steps after admission see it."""

    key: ApiKey
    tr: Translator
    call: UpstreamCall
    ticket: Ticket
    started: float
    generation_id: str
    deadline: float
    trace: tracing.Trace
    backend: Backend | None = None
    usage: Usage | None = None  # the latest the backend reported
    delivered: int = 0  # output pieces that reached the client (about one token each)
    ttft_ms: float | None = None
    backend_s: float = 0.0  # time spent waiting for the backend (the rest is the gateway's own)
    metered: tuple[UsageEvent, Usage] | None = None  # the event, once recorded
    lease: Lease | None = None  # the backend's in-flight slot, released with the outcome (Gateway._release)
    streamed: bool = False  # the backend was asked to stream (kiln.backends: also for some JSON clients)
    read_any: bool = False  # a stream's backend sent events (else a failure may move it to another backend)
    ended: bool = False  # a stream's backend sent its last event: its connection may serve the next request
    outcome: Outcome = Outcome.OK  # what the request says of the backend's health


def cost_of(run: Admitted, usage: Usage) -> int:
    """What `usage` costs at the request's model's prices, in nano-dollars."""
    return run.call.model.prices.cost_nano(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)


def trusted_usage(run: Admitted) -> Usage | None:
    """The backend's usage, if it is within what this request could have used."""
    usage, call = run.usage, run.call
    if usage is None:
        return None
    if usage.prompt_tokens > call.model.context_window or \
            usage.completion_tokens > call.max_output_tokens * call.outputs:
        log.warning("usage from %s for %s is out of bounds (%d prompt, %d completion tokens): estimated",
                    run.backend.url if run.backend else "?", run.generation_id,
                    usage.prompt_tokens, usage.completion_tokens)
        return None
    return usage


async def estimated_usage(upstream: Upstream, run: Admitted) -> Usage:
    """Usage the backend never reported (client left, stream cut): the prompt from the
    backend's tokenizer, the output from the pieces delivered. Marked inexact."""
    call, asked = run.call, run.call.prompt()
    prompt = None
    if run.backend is not None:
        prompt = await backends.count(upstream, [run.backend], asked)
    if prompt is None:
        prompt = backends.estimate(asked)
        log.warning("usage for %s estimated without the backend's tokenizer", run.generation_id)
    completion = min(run.delivered, call.max_output_tokens * call.outputs)
    return Usage(min(prompt, call.model.context_window), 0, completion, 0, exact=False)

"""The path of every metered request, top to bottom, in one place.

    authenticate -> read body (bounded) -> parse -> translate & validate
    -> maintenance? -> admit -> route -> call upstream
    -> translate back (JSON or stream) -> meter -> respond

Each step lives in its own module; this file only orders them and owns the
failure handling between them: what a failure costs (nothing, unless a
model produced tokens), which error shape the client sees (its protocol's),
and that admission is always released and usage always recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from email.utils import format_datetime
from datetime import datetime, timezone
from typing import Any

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response

from kiln.affinity import affinity_key
from kiln.catalog import Backend, Catalog
from kiln.config import Settings
from kiln.core import errors
from kiln.core.accounts import Accounts
from kiln.core.clock import CLOCK
from kiln.core.admission import AdmissionControl, Demand, Ticket
from kiln.core.errors import GatewayError
from kiln.core.keys import bearer_token
from kiln.core.ledger import Ledger, new_generation_id
from kiln.core.records import ApiKey, UsageEvent
from kiln.http import StreamResponse, Write, read_body, wait_disconnect
from kiln.protocols.base import Translator
from kiln.health import Outcome
from kiln.router import Lease, Router, outcome_of
from kiln.upstream import Upstream, sse_batches

log = logging.getLogger("kiln.pipeline")

GENERATION_HEADER = "X-Neocloud-Generation-Id"
# What a translator raises on a body that is not the JSON a model server sends: a 502, never a 500.
_MALFORMED = (ValueError, TypeError, KeyError, AttributeError)
CAPPED_HEADER = "X-Kiln-Output-Capped"  # max_tokens lowered to what the money left covers
BUDGET_NOTE = "Output stopped: the remaining credit, budget or key spend limit covers no more tokens."


@dataclass
class Maintenance:
    until: float | None = None  # Unix time; None: not in maintenance
    message: str = "The service is in maintenance."

    @property
    def active(self) -> bool:
        return self.until is not None and self.until > CLOCK.time()

    def error(self) -> GatewayError:
        assert self.until is not None
        when = format_datetime(datetime.fromtimestamp(self.until, timezone.utc), usegmt=True)
        return errors.unavailable(f"{self.message} Retry after {when}.", headers={"Retry-After": when})


@dataclass
class _Call:
    """What one request carries between the steps."""

    key: ApiKey
    tr: Translator
    ticket: Ticket
    started: float
    generation_id: str
    backend: Backend | None = None
    body: dict[str, Any] | None = None
    ttft_ms: float | None = None
    affinity: str | None = None  # the routing key: requests of one conversation share it
    lease: Lease | None = None  # the backend's in-flight slot, released with the outcome in _finish
    outcome: Outcome = Outcome.OK


class Gateway:
    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        accounts: Accounts,
        admission: AdmissionControl,
        ledger: Ledger,
        upstream: Upstream,
        router: Router,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.accounts = accounts
        self.admission = admission
        self.ledger = ledger
        self.upstream = upstream
        self.router = router
        self.maintenance = Maintenance()
        self.in_flight = 0

    def authenticate(self, request: Request) -> ApiKey:
        headers = request.headers
        token, problem = bearer_token(headers.get("authorization"), headers.get("x-api-key"))
        if token is None:
            raise errors.unauthorized(problem or "No API key provided.")
        return self.accounts.authenticate(token)

    async def intake(self, request: Request) -> tuple[ApiKey, bytes, Any]:
        """Authenticate, then read the bounded body and parse it as JSON."""
        key = self.authenticate(request)
        raw = await read_body(request, self.settings.max_body_bytes)
        try:
            return key, raw, orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise errors.invalid(f"The request body is not valid JSON: {exc}.") from None

    async def handle(self, request: Request, protocol: type[Translator]) -> Response | StreamResponse:
        started = time.monotonic()
        tr = protocol(self.catalog)
        try:
            key, raw, body = await self.intake(request)
            upstream_body = tr.request(body)
            if self.maintenance.active:
                raise self.maintenance.error()
            generation_id = new_generation_id()
            ticket = await self.admission.admit(
                key, self.accounts.org(key.org_id), _demand(tr, upstream_body, len(raw)), generation_id
            )
        except GatewayError as err:
            return _reply(tr, err)
        if ticket.capped:  # the money left covers less output than asked: ask the backend for less
            upstream_body.pop("max_completion_tokens", None)
            upstream_body["max_tokens"] = ticket.output_tokens // ticket.outputs
        affinity = affinity_key(body, tr.endpoint, request.headers) if self.router.uses_affinity(tr.model) else None
        call = _Call(key, tr, ticket, started, generation_id, body=upstream_body, affinity=affinity)
        self.in_flight += 1
        try:
            if tr.stream:
                return await self._start_stream(call, request)
            return await self._complete(call, request)
        except GatewayError as err:
            await self._finish(call)
            return _reply(tr, err)
        except BaseException:
            await self._finish(call)
            raise

    # -- calling the backend ------------------------------------------------

    async def _send(self, call: _Call) -> aiohttp.ClientResponse:
        """POST to a backend chosen by the router, which fails over before the first byte."""
        resp, call.lease = await self.router.send(
            call.tr.model, call.tr.upstream_path, call.tr.upstream_body, call.affinity, call.tr.stream)
        call.backend = call.lease.backend
        return resp

    async def _complete(self, call: _Call, request: Request) -> Response:
        """Non-streaming: one upstream JSON body, cancelled if the client leaves."""
        work = asyncio.ensure_future(self._fetch(call))
        watcher = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait(
                (work, watcher), timeout=self.settings.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            watcher.cancel()
        if work not in done:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            timed_out = not done
            await self._meter(call, status="timeout" if timed_out else "cancelled", cancelled=not timed_out)
            if timed_out:
                raise errors.timeout("The request took longer than the gateway's time limit.")
            return Response(b"", status_code=499)
        raw = work.result()
        try:
            call.tr.response(raw)
        except _MALFORMED as exc:
            log.exception("malformed response from %s", call.backend.url if call.backend else "?")
            call.outcome = Outcome.ERROR
            raise errors.bad_gateway("The model backend returned a malformed response.") from exc
        event = await self._meter(call)
        headers = {GENERATION_HEADER: call.generation_id}
        if call.ticket.capped:
            headers[CAPPED_HEADER] = str(call.ticket.output_tokens)
        return Response(call.tr.render(event.cost_nano), media_type="application/json", headers=headers)

    async def _fetch(self, call: _Call) -> bytes:
        resp = await self._send(call)
        try:
            return await resp.read()
        except aiohttp.ClientError as exc:
            call.outcome = Outcome.ERROR
            raise errors.bad_gateway("The model backend closed the connection mid-response.") from exc
        finally:
            resp.release()

    # -- streaming -------------------------------------------------------------

    async def _start_stream(self, call: _Call, request: Request) -> Response | StreamResponse:
        """Wait for the upstream status while we still can answer with an error.

        If the backend has not answered within one keepalive interval, commit
        to the 200 and keep the client's connection alive while it thinks.
        """
        pending = asyncio.ensure_future(self._send(call))
        done, _ = await asyncio.wait((pending,), timeout=self.settings.keepalive_s)
        first = b""
        if done:
            resp = pending.result()  # raises the mapped GatewayError before any byte is sent

            async def produce(write: Write) -> None:
                await self._pump(call, resp, write)
        else:
            first = call.tr.keepalive()  # one interval of silence already passed

            async def produce(write: Write) -> None:
                try:
                    resp = await pending
                except GatewayError as err:
                    # The 200 and the generation id are out: record a zero-cost event under that id.
                    await self._meter(call, status="error")
                    await write(call.tr.stream_error(err))
                    return
                except BaseException:
                    await self._finish(call)
                    raise
                await self._pump(call, resp, write)

        return StreamResponse(
            produce,
            {GENERATION_HEADER: call.generation_id},
            call.tr.keepalive,
            self.settings.keepalive_s,
            first,
        )

    async def _pump(self, call: _Call, resp: aiohttp.ClientResponse, write: Write) -> None:
        """Upstream SSE -> client frames; meter before the last byte."""
        tr = call.tr
        status, cancelled = "ok", True
        try:
            deadline = call.started + self.settings.request_timeout_s
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + (deadline - time.monotonic())):
                async for batch in sse_batches(resp):
                    # One write for all that arrived in one read: far fewer syscalls under load.
                    frames = []
                    for payload in batch:
                        try:
                            frames.append(tr.chunk(payload))
                        except GatewayError:  # the backend's in-stream error: what came before it still goes out
                            if any(frames):
                                await write(b"".join(frames))
                            raise
                        if tr.done:
                            break
                        if tr.chunks >= call.ticket.output_tokens and not await self._extend(call):
                            # The money left covers no more output: end cleanly, as if at max_tokens.
                            frames.append(tr.truncate(BUDGET_NOTE))
                            tr.done = True
                            break
                    out = b"".join(frames)
                    if out:
                        if call.ttft_ms is None:
                            call.ttft_ms = (time.monotonic() - call.started) * 1000
                        await write(out)
                    if tr.done:
                        break
            if not tr.done:
                raise errors.bad_gateway("The model backend ended the stream early.")
            cancelled = False
            event = await self._meter(call)
            await write(tr.finish(event.cost_nano))
        except (GatewayError, aiohttp.ClientError, TimeoutError, *_MALFORMED) as exc:
            cancelled = False
            if isinstance(exc, TimeoutError):
                err, status = errors.timeout("The request took longer than the gateway's time limit."), "timeout"
            elif isinstance(exc, GatewayError):
                err, status = exc, "error"
            elif isinstance(exc, aiohttp.ClientError):
                err, status = errors.bad_gateway("The model backend closed the connection mid-stream."), "error"
            else:
                log.exception("malformed stream from %s", call.backend.url if call.backend else "?")
                err, status = errors.bad_gateway("The model backend sent a malformed stream."), "error"
            call.outcome = outcome_of(exc)
            await self._meter(call, status=status)
            await write(tr.stream_error(err))
        finally:
            resp.close()  # cancels the generation on the backend if it is still running
            if cancelled:
                # The client went away: bill what was generated, off the response path.
                asyncio.ensure_future(self._meter(call, status="cancelled", cancelled=True))

    # -- metering ----------------------------------------------------------------

    async def _meter(self, call: _Call, status: str = "ok", cancelled: bool = False) -> UsageEvent:
        """Write the usage event (durable when this returns) and release admission."""
        tr = call.tr
        if not tr.usage.exact and (tr.chunks or status != "error"):
            await self._estimate_usage(call)
        u = tr.usage
        event = UsageEvent(
            id=call.generation_id,
            created_at=CLOCK.time(),
            org_id=call.key.org_id,
            project_id=call.key.project_id,
            key_id=call.key.id,
            model=tr.model.id,
            endpoint=tr.endpoint,
            prompt_tokens=u.prompt_tokens,
            cached_tokens=u.cached_tokens,
            completion_tokens=u.completion_tokens,
            reasoning_tokens=u.reasoning_tokens,
            cost_nano=tr.model.prices.cost_nano(u.prompt_tokens, u.cached_tokens, u.completion_tokens),
            status=status,
            cancelled=cancelled,
            ttft_ms=call.ttft_ms,
            duration_ms=(time.monotonic() - call.started) * 1000,
        )
        await self._finish(call, event.cost_nano, u.prompt_tokens + u.completion_tokens)
        await self.ledger.record(event)
        return event

    async def _extend(self, call: _Call) -> bool:
        key, u = call.key, call.tr.usage
        delivered = call.tr.model.prices.cost_nano(u.prompt_tokens, u.cached_tokens,
                                                   max(u.completion_tokens, call.tr.chunks))
        return await self.admission.extend(call.ticket, key, self.accounts.org(key.org_id),
                                           delivered_nano=delivered) > 0

    async def _estimate_usage(self, call: _Call) -> None:
        """Usage when the backend never reported it (client left, stream cut).

        Prompt tokens from the backend's tokenizer (vLLM /tokenize with the
        same messages); completion tokens from the chunks seen (about one
        token each on vLLM). Marked inexact.
        """
        u = call.tr.usage
        u.completion_tokens = max(u.completion_tokens, call.tr.chunks)
        if u.prompt_tokens or call.backend is None or call.body is None:
            return
        payload = {k: call.body[k] for k in ("model", "messages", "tools", "prompt") if k in call.body}
        try:
            result = await self.upstream.post_json(
                call.backend, call.backend.url.removesuffix("/v1") + "/tokenize", payload, timeout_s=10.0
            )
            u.prompt_tokens = int(result["count"])  # type: ignore[index]
        except Exception:
            u.prompt_tokens = len(orjson.dumps(payload.get("messages") or payload.get("prompt") or "")) // 4
            log.warning("usage for %s estimated without the backend's tokenizer", call.generation_id)

    async def _finish(self, call: _Call, cost_nano: int = 0, tokens: int = 0) -> None:
        """Charge the cost and release the request's admission (reservation and slot) and its
        backend lease; idempotent."""
        if call.lease is not None:
            call.lease.release(call.outcome)
        if not call.ticket.released:
            self.in_flight -= 1
            key = call.key
            await self.admission.settle(call.ticket, key, self.accounts.org(key.org_id), cost_nano, tokens)


def _demand(tr: Translator, body: dict[str, Any], body_bytes: int) -> Demand:
    """The most a request can cost: one prompt token per body byte (no more than the
    context window holds), and its output cap."""
    prices = tr.model.prices
    asked = body.get("max_tokens") or body.get("max_completion_tokens")
    max_output = min(asked, tr.model.max_output_tokens) if isinstance(asked, int) else tr.model.max_output_tokens
    return Demand(
        prompt_tokens_max=min(body_bytes, tr.model.context_window),
        input_nano_per_token=prices.input * 1000,
        output_nano_per_token=prices.output * 1000,
        max_output_tokens=max_output,
        stream=tr.stream,
        model=tr.model.id,
        endpoint=tr.endpoint,
    )


def _reply(tr: Translator, err: GatewayError) -> Response:
    reply = tr.error(err)
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)

"""The path of every metered request, top to bottom, in one place.

    intake (authenticate, bounded body, JSON) -> translate & validate (UpstreamCall)
    -> maintenance? -> admit -> route & call the backend
    -> translate back (JSON, or stream chunk by chunk) -> meter -> respond

Each step lives in its own module; this file only orders them and owns the
failure handling between them:

- what a request costs when something fails (one policy, README "Billing"):
  a failure of the gateway or the backend costs only what reached the client
  (nothing, when nothing did), a client that leaves pays for what was
  generated, and every request that passed admission and did not fail for
  the client's own mistake leaves exactly one usage event, whose id the
  client receives;
- which error shape the client sees (its protocol's): a GatewayError from any
  step, and a defect of Kiln's own as a 500 (logged here with its traceback);
- that admission is always released, and a stream billed even when it is cut.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Any, Callable, Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response

from kiln import access_log, backends, client, metrics, observe, tracing
from kiln.admitted import Admitted, cost_of, estimated_usage, trusted_usage
from kiln.assemble import assemble
from kiln.affinity import affinity_key
from kiln.catalog import Backend, Catalog
from kiln.config import Settings
from kiln.core import errors
from kiln.core.accounts import Accounts
from kiln.core.admission import AdmissionControl
from kiln.core.clock import Clock
from kiln.core.errors import GatewayError
from kiln.core.keys import bearer_token
from kiln.core.ledger import Ledger, new_generation_id
from kiln.core.maintenance import Maintenance
from kiln.core.records import ApiKey, Usage, UsageEvent
from kiln.deadline import Deadline
from kiln.http import DisconnectGuard, JSONAnswer, StreamOut, StreamResponse, Write, header_map, read_body
from kiln.protocols.base import Context, Translator, UpstreamCall
from kiln.health import Outcome
from kiln.router import Router, outcome_of
from kiln.running import running_loop
from kiln.upstream import END_OF_STREAM, Upstream

log = logging.getLogger("kiln.pipeline")

GENERATION_HEADER = "X-Neocloud-Generation-Id"
CAPPED_HEADER = "X-Kiln-Output-Capped"  # max_tokens lowered to what the money left covers
BUDGET_NOTE = "Output stopped: the remaining credit, budget or key spend limit covers no more tokens."
REQUEST_TIMEOUT = "The request took longer than the gateway's time limit."
KEY_NOTE = "This API key is no longer active: the stream was stopped."

MakeTranslator = Callable[[Context], Translator]


class Gateway:
    def __init__(self, settings: Settings, catalog: Catalog, accounts: Accounts, admission: AdmissionControl,
                 ledger: Ledger, upstream: Upstream, router: Router, ctx: Context, clock: Clock) -> None:
        self.settings = settings
        self.catalog = catalog
        self.accounts = accounts
        self.admission = admission
        self.ledger = ledger
        self.upstream = upstream
        self.router = router
        self.ctx = ctx
        self.clock = clock
        self.maintenance = Maintenance(clock)
        self.in_flight = 0
        self._background: set[asyncio.Future[Any]] = set()  # the metering of cut streams

    def spawn(self, work: Any) -> None:
        """Run a coroutine off the response path, tracked: shutdown waits for it (`drain`)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float) -> None:
        """Shutdown: wait until every admitted request is settled and metered (at most `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while (self.in_flight or self._background) and time.monotonic() < deadline:
            if self._background:
                await asyncio.wait(list(self._background), timeout=deadline - time.monotonic())
            else:
                await asyncio.sleep(0.05)
        if self.in_flight or self._background:
            log.error("shutdown: %d requests unsettled after %.0f s", self.in_flight, timeout_s)

    # -- intake ------------------------------------------------------------------

    def authenticate(self, headers: Mapping[str, str]) -> ApiKey:
        token, problem = bearer_token(headers.get("authorization"), headers.get("x-api-key"))
        if token is None:
            raise errors.unauthorized(problem or "No API key provided.")
        return self.accounts.authenticate(token)

    async def intake(self, request: Request, headers: Mapping[str, str]) -> tuple[ApiKey, bytes, Any]:
        """Authenticate, then read the bounded body and parse it as JSON."""
        key = self.authenticate(headers)
        raw = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
        try:
            return key, raw, orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise errors.invalid(f"The request body is not valid JSON: {exc}.") from None

    # -- the request ----------------------------------------------------------------

    async def handle(self, request: Request, make: MakeTranslator) -> Response | JSONAnswer | StreamResponse:
        started = time.monotonic()
        tr = make(self.ctx)
        headers = header_map(request.scope)
        trace = tracing.begin(headers, tr.endpoint)
        key: ApiKey | None = None
        call: UpstreamCall | None = None
        try:
            key, raw, body = await self.intake(request, headers)
            call = _translated(tr, body)
            if self.maintenance.active:
                raise self.maintenance.error()
            if self.ledger.degraded:  # usage could not be recorded: refuse before any work is done
                raise self.ledger.unavailable()
            generation_id = new_generation_id()
            ticket = await self.admission.admit(key, self.accounts.org(key.org_id),
                                                call.demand(tr.endpoint, len(raw)), generation_id)
        except GatewayError as err:
            observe.refused(tr.endpoint, err, started=started, key=key, model=call.model.id if call else None,
                            trace=trace)
            return _reply(tr, err)
        if call.kind == "count":
            return await self._count(tr, call, key, started, trace)
        if ticket.capped:  # the money left covers less output than asked: ask the backend for less
            call.lower_cap(ticket.output_tokens // ticket.outputs)
        if self.router.uses_affinity(call.model):  # else no routing key is worth its hash
            call.affinity = affinity_key(body, tr.endpoint, headers)
        run = Admitted(key, tr, call, ticket, started, generation_id, started + self.settings.request_timeout_s, trace)
        self.in_flight += 1
        try:
            if call.stream:
                return self._stream(run)
            return await self._complete(run, request)
        except GatewayError as err:
            return await self._failed(run, err)
        except Exception:
            log.exception("internal error on %s (%s)", tr.endpoint, generation_id)
            return await self._failed(run, errors.internal())
        except BaseException:
            await self._release(run)
            raise

    async def _failed(self, run: Admitted, err: GatewayError) -> Response:
        """An error answer after admission. The gateway's or the backend's failures are recorded
        (cost 0: nothing reached the client) under an id the client receives; the client's
        own mistakes (a 4xx from the backend) are not billed and leave no event."""
        run.outcome = outcome_of(err)
        if err.status < 500:
            await self._release(run)
            self._observe(run, err.status, metrics.error_type(err.status, err.backend))
            return _reply(run.tr, err)
        await self._meter(run, status="timeout" if err.status == 504 else "error")
        self._observe(run, err.status, metrics.error_type(err.status, err.backend))
        return _reply(run.tr, err, {GENERATION_HEADER: run.generation_id})

    # -- calling the backend ------------------------------------------------

    async def _send(self, run: Admitted, failed: list[Backend] | None = None) -> client.Response:
        """POST to a backend the router chooses (none of `failed`); it fails over before the
        backend's answer starts."""
        call = run.call

        async def post(backend: Backend) -> client.Response:
            run.backend = backend
            body, run.streamed = _prepared(call, backend)
            headers = tracing.backend_headers(run.trace, call.model.id, backend.url)
            sent = time.monotonic()
            try:
                return await self.upstream.post(backend, call.path, body, stream=run.streamed, headers=headers)
            finally:
                run.backend_s += time.monotonic() - sent

        resp, run.lease = await self.router.send(call.model, call.affinity, post, call.stream, failed or ())
        return resp

    async def _complete(self, run: Admitted, request: Request) -> Response | JSONAnswer:
        """Non-streaming: one upstream JSON body, cancelled if the client leaves."""
        try:
            with DisconnectGuard(request.receive, request.scope) as guard:
                with Deadline(run.deadline - time.monotonic()):
                    raw = await self._fetch(run)
        except TimeoutError:
            raise errors.timeout(REQUEST_TIMEOUT) from None
        if guard.fired:
            run.outcome = Outcome.CANCELLED
            await self._meter(run, status="cancelled", cancelled=True)
            self._observe(run, 499, "cancelled")
            return Response(b"", status_code=499)
        run.usage = run.tr.response(raw)
        event, usage = await self._meter(run)
        headers = {GENERATION_HEADER: run.generation_id}
        if run.ticket.capped:
            headers[CAPPED_HEADER] = str(run.call.max_output_tokens)
        body = run.tr.render(usage, event.cost_nano)
        self._observe(run, 200)
        return JSONAnswer(body, headers)

    async def _fetch(self, run: Admitted) -> bytes:
        """The backend's JSON answer; assembled from its stream when it was asked to stream."""
        resp = await self._send(run)
        started = time.monotonic()
        try:
            if not run.streamed:
                return await self.upstream.read(resp)
            stops = run.call.body.get("stop") or []
            answer = await assemble(self.upstream.events(resp), run.call.path == "/chat/completions",
                                    [stops] if isinstance(stops, str) else stops)
            run.delivered = answer.pieces  # the output's size if the backend's usage never came
            run.ended = answer.complete
            return answer.body
        finally:
            if run.streamed:  # unless it ended, cancels what is left of the generation
                resp.close(ended=run.ended)
            run.backend_s += time.monotonic() - started

    # -- streaming -------------------------------------------------------------

    def _stream(self, run: Admitted) -> StreamResponse:
        def keepalive() -> bytes:
            metrics.record_keepalive(run.tr.endpoint)
            return run.tr.keepalive()

        return StreamResponse(lambda out: self._pump(run, out), {GENERATION_HEADER: run.generation_id}, keepalive,
                              self.settings.keepalive_s)

    async def _pump(self, run: Admitted, out: StreamOut) -> bytes | Response:
        """Backend SSE -> client frames; meter before the last byte, whatever happens. Returns
        the last frames (the last output, the usage and end events, or the error), which end the
        response, or an error response if the backend failed before the 200 went out.

        The 200 goes out with the first frames, not when the backend's headers arrive: one
        write, not two, and a backend that fails before its first token gets the client a
        plain error status. If the backend takes longer than a keepalive interval, the 200
        goes out with a keepalive meanwhile, and a refusal then comes in the stream."""
        tr = run.tr
        resp: client.Response | None = None
        left = True  # the client went away (this task was cancelled) unless we learn otherwise
        last = b""  # the last read's frames, held for the end of the response
        try:
            try:
                with Deadline(run.deadline - time.monotonic()):  # one timer for the whole stream
                    failed: list[Backend] = []
                    while True:
                        resp = await self._send(run, failed)
                        try:
                            last = await self._forward(run, resp, out.write)
                            break
                        except GatewayError as err:
                            if not self._may_move(run, out, err, failed):
                                raise
                            resp.close()
                            resp = None
                            self._moved(run, err, failed)
            except TimeoutError:
                raise errors.timeout(REQUEST_TIMEOUT) from None
            out.stop_keepalives()  # the last frames wait for the commit: nothing may come between
            left = False
            event, usage = await self._meter(run)
            self._observe(run, 200)
            return last + tr.finish(usage, event.cost_nano)
        except GatewayError as err:
            left = False
            if not last and not out.committed():  # the backend failed before the 200 went out
                return await self._failed(run, err)
            run.outcome = outcome_of(err)
            await self._meter(run, status="timeout" if err.status == 504 else "error")
            self._observe(run, 200, metrics.error_type(err.status, err.backend))
            return last + tr.stream_error(err)
        except Exception:
            left = False
            log.exception("internal error in a %s stream (%s)", tr.endpoint, run.generation_id)
            if not last and not out.committed():
                return await self._failed(run, errors.internal())
            run.outcome = Outcome.CANCELLED  # a defect of ours says nothing about the backend
            await self._meter(run, status="error")
            self._observe(run, 200, "internal")
            return last + tr.stream_error(errors.internal())
        finally:
            if resp is not None:  # unless it ended, cancels the generation on the backend
                resp.close(ended=run.ended)
            if left:  # bill what was generated, off the response path but tracked
                self.spawn(self._cut(run))

    def _may_move(self, run: Admitted, out: StreamOut, err: GatewayError, failed: list[Backend]) -> bool:
        """Whether a stream whose backend failed can move to another one: it failed before sending
        anything (nothing was read from it, nothing reached the client), and another backend is
        left within `retries`."""
        if not err.backend or run.read_any or out.started or run.backend is None:
            return False
        if len(failed) >= self.settings.routing.retries:
            return False
        return any(b is not run.backend and b not in failed for b in run.call.model.backends)

    def _moved(self, run: Admitted, err: GatewayError, failed: list[Backend]) -> None:
        backend, lease = run.backend, run.lease
        assert backend is not None and lease is not None
        log.warning("backend %s failed %s before its first output (%s); moving it to another backend",
                    access_log.safe_url(backend.url), run.generation_id, err.message)
        lease.release(outcome_of(err), error=err.message)
        run.lease = None
        failed.append(backend)

    async def _forward(self, run: Admitted, resp: client.Response, write: Write) -> bytes:
        """Forward the stream until the translator needs no more of it; then the frames of the
        last read, not yet written (they go out with the end of the response: one write, not
        two). A backend stream that ends first is a 502."""
        tr, ticket = run.tr, run.ticket
        waiting = time.monotonic()
        async for batch in self.upstream.events(resp):
            run.backend_s += time.monotonic() - waiting
            run.read_any = True
            # One write for all that arrived in one read: far fewer syscalls under load.
            frames: list[bytes] = []
            done = False
            i, n = 0, len(batch)
            try:
                while i < n:
                    # Several at once where they allow, short of the output the money covers.
                    run_of = tr.chunks(batch, i, ticket.output_tokens - run.delivered - 1) if n - i > 1 else None
                    if run_of is not None:
                        out, usage, pieces, taken = run_of
                        frames.append(out)
                        if usage is not None:
                            run.usage = usage
                        run.delivered += pieces
                        i += taken
                        continue
                    out, usage, pieces, done = tr.chunk(batch[i])
                    i += 1
                    frames.append(out)
                    if usage is not None:
                        run.usage = usage
                    run.delivered += pieces
                    if done:
                        break
                    if run.delivered >= ticket.output_tokens and not await self._extend(run):
                        # The money left covers no more output: end cleanly, as if at max_tokens.
                        frames.append(tr.truncate(BUDGET_NOTE))
                        done = True
                        break
            except GatewayError:  # what came before the error still goes out
                await self._write(run, write, frames)
                raise
            if done:
                run.ended = batch[i - 1] == END_OF_STREAM
                last = b"".join(frames)
                if last and run.ttft_ms is None:
                    run.ttft_ms = (time.monotonic() - run.started) * 1000
                return last
            await self._write(run, write, frames)
            waiting = time.monotonic()
        raise errors.bad_gateway("The model backend ended the stream early.")

    @staticmethod
    async def _write(run: Admitted, write: Write, frames: list[bytes]) -> None:
        out = b"".join(frames)
        if out:
            if run.ttft_ms is None:
                run.ttft_ms = (time.monotonic() - run.started) * 1000
            await write(out)

    async def _extend(self, run: Admitted) -> bool:
        """Reserve the next block of output; False when the money left covers none. A key
        suspended or revoked meanwhile ends its streams here (403 in the stream)."""
        key = run.key
        if key.status != "active":
            raise errors.forbidden(f"{KEY_NOTE} (the key is {key.status})", code=f"key_{key.status}")
        delivered = cost_of(run, trusted_usage(run) or Usage(0, 0, run.delivered))
        return await self.admission.extend(run.ticket, key, self.accounts.org(key.org_id),
                                           delivered_nano=delivered) > 0

    # -- count_tokens ----------------------------------------------------------------

    async def _count(self, tr: Translator, call: UpstreamCall, key: ApiKey, started: float,
                     trace: tracing.Trace) -> Response:
        """The exact prompt size from a backend's tokenizer; an estimate (logged) if none can count."""
        try:
            candidates = self.router.candidates(call.model)
        except GatewayError:
            candidates = []
        asked = call.prompt()
        count = await backends.count(self.upstream, candidates, asked)
        if count is None:
            count = backends.estimate(asked)
            log.warning("count_tokens for %s is an estimate: no backend tokenizer answered", call.model.id)
        observe.finished(tr.endpoint, call.model.id, 200, "none", started=started, key=key, event=None,
                         backend_url=None, backend_s=0.0, trace=trace)
        return Response(tr.render(Usage(count), 0), media_type="application/json")

    # -- metering ----------------------------------------------------------------

    async def _meter(self, run: Admitted, status: str = "ok", cancelled: bool = False) -> tuple[UsageEvent, Usage]:
        """Write the usage event (durable when this returns) and release admission; once per run
        (a second outcome for the same request, e.g. cut while failing, keeps the first)."""
        if run.metered is not None:
            return run.metered
        failed = status not in ("ok", "cancelled")
        if failed and not run.delivered:
            usage = Usage()  # nothing reached the client: nothing is billed
        else:
            usage = trusted_usage(run) or await estimated_usage(self.upstream, run)
        key, tr = run.key, run.tr
        event = UsageEvent(
            id=run.generation_id, created_at=self.clock.time(), org_id=key.org_id, project_id=key.project_id,
            key_id=key.id, model=run.call.model.id, endpoint=tr.endpoint, prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
            reasoning_tokens=usage.reasoning_tokens, cost_nano=cost_of(run, usage), status=status,
            cancelled=cancelled, ttft_ms=run.ttft_ms, duration_ms=(time.monotonic() - run.started) * 1000,
            streamed=run.call.stream, finish_reason=tr.finish_reason(),
            backend=access_log.safe_url(run.backend.url) if run.backend else None,
        )
        if run.metered is not None:  # metered meanwhile, while this one estimated
            return run.metered
        run.metered = event, usage
        await self._release(run, event.cost_nano, usage.prompt_tokens + usage.completion_tokens)
        await self.ledger.record(event)
        return event, usage

    async def _release(self, run: Admitted, cost_nano: int = 0, tokens: int = 0) -> None:
        """Charge the cost and release the request's admission (reservation and slot) and its
        backend lease (with what the request says of the backend's health); idempotent."""
        if run.lease is not None:
            run.lease.release(run.outcome)
        if not run.ticket.released:
            self.in_flight -= 1
            key = run.key
            await self.admission.settle(run.ticket, key, self.accounts.org(key.org_id), cost_nano, tokens)

    async def _cut(self, run: Admitted) -> None:
        """A stream whose client left: bill what was generated."""
        run.outcome = Outcome.CANCELLED
        await self._meter(run, status="cancelled", cancelled=True)
        self._observe(run, 499, "cancelled")

    def _observe(self, run: Admitted, status: int, error: str = "none") -> None:
        """Metrics, the access-log line and the trace's end, once the answer has gone out: the
        loop's next turn, so none of it sits between the backend's answer and the client's."""
        running_loop().call_soon(partial(
            observe.finished, run.tr.endpoint, run.call.model.id, status, error, started=run.started, key=run.key,
            event=run.metered[0] if run.metered is not None else None,
            backend_url=run.backend.url if run.backend else None, backend_s=run.backend_s, trace=run.trace))


TOO_DEEP = "The request is nested too deeply to forward (at most 254 levels)."


def _translated(tr: Translator, body: Any) -> UpstreamCall:
    """The translator's upstream call; a body orjson parses but cannot write back (nested deeper
    than 254 levels) is the client's 400, wherever the translator re-encodes a piece of it."""
    try:
        return tr.request(body)
    except orjson.JSONEncodeError:
        raise errors.invalid(TOO_DEEP) from None


def _prepared(call: UpstreamCall, backend: Backend) -> tuple[bytes, bool]:
    try:
        return backends.prepare(call, backend)
    except orjson.JSONEncodeError:
        raise errors.invalid(TOO_DEEP) from None


def _reply(tr: Translator, err: GatewayError, headers: dict[str, str] | None = None) -> Response:
    reply = tr.error(err)
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type,
                    headers={**reply.headers, **(headers or {})})

"""The ASGI application: routes, and the lifespan that opens and closes
the store, the ledger writer, the upstream pool and the health probe.

Plain ASGI through Starlette, so uvicorn serves it by default and Granian
can too.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timezone
from typing import AsyncIterator, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from kiln import access_log, admin, console, metrics, tracing, usage
from kiln.catalog import Catalog, Model
from kiln.config import Settings
from kiln.core import errors
from kiln.core.admission import AdmissionControl
from kiln.core.clock import CLOCK, Clock
from kiln.core.errors import GatewayError
from kiln.core.keys import bearer_token
from kiln.core.money import nano_to_usd_str
from kiln.http import JSONAnswer, StreamResponse
from kiln.pipeline import Gateway, MakeTranslator
from kiln.protocols.anthropic.count_tokens import CountTokensTranslator
from kiln.protocols.anthropic.messages import MessagesTranslator, anthropic_error
from kiln.protocols.base import Context, Reply
from kiln.protocols.openai.chat import ChatTranslator
from kiln.protocols.openai.completions import CompletionsTranslator
from kiln.protocols.openai.errors import openai_error
from kiln.protocols.openai.responses import ResponsesTranslator
from kiln.protocols.reasoning import ReasoningSeal, reasoning_key
from kiln.router import Router
from kiln.store.base import Store
from kiln.upstream import Limits, Upstream
from kiln.wiring import build_catalog, close_parts, degraded, open_parts, start_propagation

log = logging.getLogger("kiln")
DRAIN_S = 15.0  # shutdown: the longest the metering of cut streams may take (tokenizer call included)

# The metered endpoints, and count_tokens, which shares their intake: path -> its translator.
METERED: dict[str, MakeTranslator] = {
    "/v1/chat/completions": ChatTranslator,
    "/v1/completions": CompletionsTranslator,
    "/v1/responses": ResponsesTranslator,
    "/v1/messages": MessagesTranslator,
    "/v1/messages/count_tokens": CountTokensTranslator,
}


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(err: GatewayError) -> Response:
    return _reply(openai_error(err))


class KilnApp:
    """The ASGI entry point.

    POSTs to the metered endpoints go straight to the pipeline; everything
    else (models, key, health, admin, unknown paths) goes through Starlette's
    router. Skipping Starlette's middleware and routing layers on the hot
    path is worth about a fifth of the gateway's CPU per request.
    """

    def __init__(self, inner: Starlette) -> None:
        self.inner = inner
        self.state = inner.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        make = METERED.get(scope["path"]) if scope["type"] == "http" else None
        if make is None:
            await self.inner(scope, receive, send)
            return
        gw: Gateway = self.state.gateway
        response: Response | JSONAnswer | StreamResponse
        if scope["method"] != "POST":
            response = _reply(make(gw.ctx).error(GatewayError(
                405, f"Method {scope['method']} is not allowed on {scope['path']}; use POST.",
                code="method_not_allowed")))
        else:
            try:
                response = await gw.handle(Request(scope, receive), make)
            except Exception:
                log.exception("unhandled error on POST %s", scope["path"])
                response = _reply(make(gw.ctx).error(errors.internal()))
        await response(scope, receive, send)


def _reply(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)


async def list_models(request: Request) -> Response:
    """GET /v1/models: OpenAI's list (with Codex's catalog beside it), or Anthropic's when the
    request is Anthropic's (an `anthropic-version` header: the Anthropic SDKs always send one)."""
    gw: Gateway = request.app.state.gateway
    try:
        gw.authenticate(request.headers)
    except GatewayError as err:
        return _reply(anthropic_error(err)) if "anthropic-version" in request.headers else _error(err)
    names = [(name, model) for model in gw.catalog.available() for name in (model.id, *model.aliases)]
    if "anthropic-version" in request.headers:
        data = [_anthropic_listing(name, model) for name, model in names]
        return _json({"data": data, "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, "has_more": False})
    listed, codex = [], []  # the OpenAI list, and beside it the catalog Codex reads
    for name, model in names:
        entry = model.listing()
        listed.append(entry if name == model.id else {**entry, "id": name, "alias_of": model.id})
        codex.append(model.codex_listing(name, len(codex)))
    return _json({"object": "list", "data": listed, "models": codex})


def _anthropic_listing(name: str, model: Model) -> dict[str, object]:
    """Anthropic's ModelInfo, with Kiln's extensions under the names the OpenAI list uses."""
    extensions = {k: v for k, v in model.listing().items() if k not in ("id", "object", "created", "owned_by")}
    created = datetime.fromtimestamp(model.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    entry: dict[str, object] = {"type": "model", "id": name, "display_name": name, "created_at": created,
                                "lifecycle": "active", "max_input_tokens": model.context_window,
                                "max_tokens": model.max_output_tokens, **extensions}
    if name != model.id:
        entry["alias_of"] = model.id
    return entry


async def key_info(request: Request) -> Response:
    """GET /v1/key: Bearer only, per the contract.

    Served for suspended and revoked keys too (an expired key is a 401, like
    everywhere): this is where a key's owner learns why the gateway refuses it.
    """
    gw: Gateway = request.app.state.gateway
    token, problem = bearer_token(request.headers.get("authorization"), None)
    key = gw.accounts.lookup(token) if token is not None else None
    if key is None:
        return _error(errors.unauthorized(problem or "Invalid API key."))
    if key.expires_at is not None and key.expires_at <= gw.clock.time():
        return _error(errors.unauthorized("This API key has expired."))
    project = gw.accounts.projects[key.project_id]
    try:
        limits = await gw.admission.state(key, gw.accounts.org(key.org_id))
    except GatewayError as err:  # shared admission unreachable
        return _error(err)
    spendable = limits.pop("spendable_nano")
    return _json(
        {
            "id": key.id,
            "name": key.name,
            "prefix": key.prefix,
            "project": {"id": project.id, "name": project.name},
            "org_id": key.org_id,
            "status": key.status,
            "spend_limit": None if key.spend_limit_nano is None else nano_to_usd_str(key.spend_limit_nano),
            "expires_at": None if key.expires_at is None else int(key.expires_at),
            "spend": nano_to_usd_str(key.spend_nano),
            "spend_reset": key.spend_reset,
            "period_spend": nano_to_usd_str(key.period_spend_nano),
            # What the caller can still spend: the smallest of key limit, budget and credits left.
            "spendable": nano_to_usd_str(spendable),  # type: ignore[arg-type]
            "rate_limits": limits,
        }
    )


async def health(request: Request) -> Response:
    """Without the admin credential only the state: "ok", "maintenance", or "degraded" (503, so a
    load balancer drains this replica) when metered requests are refused here: the ledger cannot
    write, shared admission (Redis) is unreachable, or no model can be served. With the admin
    credential also why, the database, model availability and requests in flight."""
    gw: Gateway = request.app.state.gateway
    maintenance = gw.maintenance.active
    models = {m.id: m.available for m in gw.catalog.models}
    problems = degraded(gw) + ([] if any(models.values()) else ["no model can be served"])
    status = "degraded" if problems else "maintenance" if maintenance else "ok"
    body: dict[str, object] = {"status": status, "maintenance_until": gw.maintenance.until if maintenance else None}
    token, _ = bearer_token(request.headers.get("authorization"), None)
    if token is not None and gw.accounts.is_admin(token):
        database_ok = gw.accounts.database_ok and not (gw.ledger.spool and gw.ledger.spool.backlog)
        body.update(problems=problems, models=models, in_flight=gw.in_flight,
                    database="ok" if database_ok else "unreachable: usage events wait in the local spool")
    return _json(body, 503 if problems else 200)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = errors.not_found(f"No such endpoint: {request.method} {request.url.path}.", code="unknown_endpoint")
    elif exc.status_code == 405:
        err = GatewayError(405, f"Method {request.method} is not allowed on {request.url.path}.",
                           code="method_not_allowed")
    else:
        err = GatewayError(exc.status_code, str(exc.detail))
    if request.url.path.startswith("/v1/messages"):  # Anthropic clients parse Anthropic errors only
        return _reply(anthropic_error(err))
    return _error(err)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(errors.internal())


def create_app(
    settings: Settings,
    *,
    catalog: Catalog | None = None,
    store: Store | None = None,
    admission: AdmissionControl | None = None,
    upstream: Upstream | None = None,
    clock: Clock = CLOCK,
    on_ready: Callable[[Gateway], object] | None = None,
) -> KilnApp:
    """The gateway as an ASGI app, assembled from parts a caller may pass in (a test builds
    one in process with its own store or clock); what is not given is made from `settings`.
    `on_ready(gateway)` runs once everything is open."""
    catalog = catalog or build_catalog(settings)
    access_log.configure(settings.log)
    tracing.configure(settings.tracing)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        parts = await open_parts(settings, store=store, admission=admission, clock=clock,
                                 on_metrics=metrics.record_ledger_commit)  # store, accounts, admission, ledger
        client = upstream or Upstream(Limits(max_body_bytes=settings.max_upstream_body_bytes,
                                             max_event_bytes=settings.max_upstream_event_bytes))
        router = Router(catalog, client, settings.routing, settings.backend_retry_s)
        await router.probe_all()
        await router.start()
        ctx = Context(catalog, ReasoningSeal(reasoning_key(settings.reasoning_secret, settings.data_dir)))
        gateway = Gateway(settings, catalog, parts.accounts, parts.admission, parts.ledger, client, router, ctx, clock)
        app.state.gateway = gateway
        await start_propagation(parts, settings, gateway.maintenance)
        metrics.bind(gateway)
        stop_metrics = metrics.serve(settings.metrics.host, settings.metrics.port) if settings.metrics.port else None
        if on_ready is not None:
            result = on_ready(gateway)
            if hasattr(result, "__await__"):
                await result  # type: ignore[misc]
        try:
            yield
        finally:
            await gateway.drain(DRAIN_S)  # the metering of cut streams, before the ledger stops
            if stop_metrics is not None:
                stop_metrics()
            await router.stop()
            await close_parts(parts)
            await client.close()
            tracing.shutdown()
            access_log.flush()

    inner = Starlette(routes=_routes(settings), lifespan=lifespan,
                      exception_handlers={HTTPException: _http_error, Exception: _server_error})
    return KilnApp(inner)


def _routes(settings: Settings) -> list[BaseRoute]:
    """Everything but the metered POSTs (KilnApp answers those before Starlette's router)."""
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/key", key_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        *admin.routes,
        *usage.routes,
        *metrics.routes,
        *console.routes,
        *(admin.test_routes if settings.test_clock else []),
    ]

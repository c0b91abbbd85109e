"""The ASGI application: routes, and the lifespan that opens and closes
the store, the ledger writer, the upstream pool and the health probe.

Plain ASGI through Starlette, so uvicorn serves it by default and Granian
can too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kiln import admin
from kiln.catalog import Catalog
from kiln.config import Settings
from kiln.core import errors
from kiln.core.accounts import Accounts
from kiln.core.clock import CLOCK
from kiln.core.admission import MemoryAdmission
from kiln.core.errors import GatewayError
from kiln.core.keys import bearer_token, hash_key
from kiln.core.ledger import Ledger
from kiln.core.money import nano_to_usd_str
from kiln.http import StreamResponse
from kiln.pipeline import Gateway
from kiln.protocols.base import Reply, Translator, openai_error
from kiln.protocols.chat import ChatTranslator
from kiln.protocols.completions import CompletionsTranslator
from kiln.protocols.count_tokens import count_tokens
from kiln.protocols.messages import MessagesTranslator
from kiln.protocols.responses import responses_protocol
from kiln.router import Router
from kiln.store import make_store
from kiln.upstream import Upstream

log = logging.getLogger("kiln")

def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _error(err: GatewayError) -> Response:
    return _reply(openai_error(err))


# The metered endpoints: path -> the translator for it (some need the settings).
METERED: dict[str, Callable[[Settings], type[Translator]]] = {
    "/v1/chat/completions": lambda _: ChatTranslator,
    "/v1/completions": lambda _: CompletionsTranslator,
    "/v1/responses": responses_protocol,
    "/v1/messages": lambda _: MessagesTranslator,
}


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
        protocol = METERED.get(scope["path"]) if scope["type"] == "http" else None
        if protocol is None:
            await self.inner(scope, receive, send)
            return
        gw: Gateway = self.state.gateway
        translator = protocol(gw.settings)
        response: Response | StreamResponse
        if scope["method"] != "POST":
            response = _reply(translator(gw.catalog).error(GatewayError(
                405, f"Method {scope['method']} is not allowed on {scope['path']}; use POST.",
                code="method_not_allowed")))
        else:
            try:
                response = await gw.handle(Request(scope, receive), translator)
            except Exception:
                log.exception("unhandled error on POST %s", scope["path"])
                response = _reply(translator(gw.catalog).error(GatewayError(
                    500, "Internal error in the gateway.", "api_error", "internal_error")))
        await response(scope, receive, send)


def _reply(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        gw.authenticate(request)
    except GatewayError as err:
        return _error(err)
    data, codex = [], []  # the OpenAI list, and beside it the catalog Codex reads
    for model in gw.catalog.available():
        entry = model.listing()
        for name in (model.id, *model.aliases):
            data.append(entry if name == model.id else {**entry, "id": name, "alias_of": model.id})
            codex.append(model.codex_listing(name, len(codex)))
    return _json({"object": "list", "data": data, "models": codex})


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
    if key.expires_at is not None and key.expires_at <= CLOCK.time():
        return _error(errors.unauthorized("This API key has expired."))
    project = gw.accounts.projects[key.project_id]
    limits = await gw.admission.state(key, gw.accounts.org(key.org_id))
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
    gw: Gateway = request.app.state.gateway
    maintenance = gw.maintenance.active
    return _json(
        {
            "status": "maintenance" if maintenance else "ok",
            "maintenance_until": gw.maintenance.until if maintenance else None,
            "models": {m.id: m.available for m in gw.catalog.models},
            "in_flight": gw.in_flight,
        }
    )


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
        return _reply(MessagesTranslator(request.app.state.gateway.catalog).error(err))
    return _error(err)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(GatewayError(500, "Internal error in the gateway.", "api_error", "internal_error"))


def create_app(settings: Settings, catalog: Catalog, on_ready: Callable[[Gateway], object] | None = None) -> KilnApp:
    """The gateway as an ASGI app; `on_ready(gateway)` runs once everything is open."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store = make_store(settings.database_url, settings.sqlite_synchronous)
        await store.open()
        accounts = Accounts(store)
        await accounts.load()
        if settings.admin_key:
            accounts.add_admin_hash(hash_key(settings.admin_key))
        ledger = Ledger(store)
        await ledger.start()
        upstream = Upstream()
        await upstream.start()
        router = Router(catalog, upstream, settings.routing, settings.backend_retry_s)
        await router.probe_all()
        await router.start()
        gateway = Gateway(settings, catalog, accounts, MemoryAdmission(settings.limits), ledger, upstream, router)
        app.state.gateway = gateway
        # Several gateways on one database: take each other's key and limit changes every few seconds.
        refresher = asyncio.create_task(accounts.refresh_forever(settings.refresh_s)) if store.shared else None
        if on_ready is not None:
            result = on_ready(gateway)
            if hasattr(result, "__await__"):
                await result  # type: ignore[misc]
        try:
            yield
        finally:
            if refresher is not None:
                refresher.cancel()
                await asyncio.gather(refresher, return_exceptions=True)
            await router.stop()
            await ledger.stop()
            await upstream.close()
            await store.close()

    routes = [
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/key", key_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        *admin.routes,
        *(admin.test_routes if settings.test_clock else []),
    ]
    inner = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    return KilnApp(inner)

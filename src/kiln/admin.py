"""The admin HTTP API under /admin/v1 (admin credential required).

Organisations, projects, keys, credits, budgets, limits, usage,
maintenance and the backends' health. Amounts go in and out as decimal USD strings (numbers are
accepted on input) and are stored as exact nanodollars.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Awaitable, Callable, Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.records import SPEND_RESETS
from kiln.core.keys import bearer_token
from kiln.core.money import nano_to_usd_str, usd_to_nano
from kiln.http import read_body
from kiln.core.maintenance import save as save_maintenance
from kiln.pipeline import Gateway
from kiln.protocols.openai.errors import openai_error

ADMIN_MAX_BODY_BYTES = 64 * 1024  # admin bodies are a few fields; a 64 MiB name is an attack
# An admin operation: the gateway, the JSON body, and the path and query parameters.
# The console calls the same operations with its form fields as the body.
Params = Mapping[str, str]
Handler = Callable[[Gateway, dict[str, Any], Params], Awaitable[Any]]


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _usd(body: dict[str, Any], name: str, *, allow_none: bool = True, signed: bool = False) -> int | None:
    """A USD amount from the body as nanodollars; negative only where `signed` (credit corrections)."""
    value = body.get(name)
    if value is None:
        if allow_none:
            return None
        raise errors.invalid(f"'{name}' is required (USD).", param=name)
    if isinstance(value, bool):
        raise errors.invalid(f"'{name}' must be a USD amount.", param=name)
    try:
        nano = usd_to_nano(value)
    except ValueError as exc:
        raise errors.invalid(f"'{name}': {exc}", param=name) from None
    if nano < 0 and not signed:
        raise errors.invalid(f"'{name}' must not be negative.", param=name)
    return nano


def _int_or_none(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise errors.invalid(f"'{name}' must be a positive integer or null.", param=name)
    return value


def parse_time(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:  # no offset given: UTC, like every date Kiln shows, whatever the server's zone
            return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
    raise errors.invalid(f"'{name}' must be a Unix time or an ISO 8601 date.", param=name)


async def list_orgs(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    return {"object": "list", "data": [o.public() for o in gw.accounts.orgs.values()]}


async def create_org(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise errors.invalid("'name' is required.", param="name")
    credits = _usd(body, "credits")  # every field is checked before anything is stored
    org = await gw.accounts.create_org(
        name,
        monthly_budget_nano=_usd(body, "monthly_budget"),
        rpm_limit=_int_or_none(body, "rpm_limit"),
        tpm_limit=_int_or_none(body, "tpm_limit"),
        concurrency_limit=_int_or_none(body, "concurrency_limit"),
    )
    if credits:
        await gw.accounts.add_credits(org.id, credits, "initial credits")
    return org.public()


async def get_org(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    org = gw.accounts.org(params["org_id"])
    await gw.ledger.settled()  # the usage recorded so far is in the totals
    totals = await gw.accounts.store.usage_totals(org.id)
    return {
        **org.public(),
        "usage_events": totals["events"],
        "total_spend": nano_to_usd_str(totals["cost_nano"]),
        "total_granted": nano_to_usd_str(totals["granted_nano"]),
        "in_flight": (await gw.admission.state(None, org))["in_flight"],
    }


async def update_org(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    fields: dict[str, Any] = {}
    if "monthly_budget" in body:
        fields["monthly_budget_nano"] = _usd(body, "monthly_budget")
    for name in ("rpm_limit", "tpm_limit", "concurrency_limit"):
        if name in body:
            fields[name] = _int_or_none(body, name)
    unknown = set(body) - {"monthly_budget", "rpm_limit", "tpm_limit", "concurrency_limit"}
    if unknown:
        raise errors.invalid(f"Unknown fields: {', '.join(sorted(unknown))}.")
    org = await gw.accounts.update_org(params["org_id"], **fields)
    return org.public()


async def add_credits(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    amount = _usd(body, "amount", allow_none=False, signed=True)
    assert amount is not None
    note = body.get("note") if isinstance(body.get("note"), str) else ""
    org = await gw.accounts.add_credits(params["org_id"], amount, note)
    return org.public()


async def list_projects(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    org_id = params.get("org_id")
    data = [p.public() for p in gw.accounts.projects.values() if org_id in (None, p.org_id)]
    return {"object": "list", "data": data}


async def create_project(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    org_id, name = body.get("org_id"), body.get("name")
    if not isinstance(org_id, str) or not isinstance(name, str) or not name:
        raise errors.invalid("'org_id' and 'name' are required.")
    return (await gw.accounts.create_project(org_id, name)).public()


async def list_keys(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    data = [
        k.public()
        for k in gw.accounts.keys.values()
        if params.get("project_id") in (None, k.project_id) and params.get("org_id") in (None, k.org_id)
    ]
    return {"object": "list", "data": data}


async def create_key(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    project_id = body.get("project_id")
    if not isinstance(project_id, str):
        raise errors.invalid("'project_id' is required.", param="project_id")
    name = body.get("name") if isinstance(body.get("name"), str) else ""
    key, secret = await gw.accounts.create_key(
        project_id, name, _usd(body, "spend_limit"), parse_time(body, "expires_at"), **_key_limits(body)
    )
    return {**key.public(), "key": secret, "note": "Store this key now: it is not shown again."}


async def update_key(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    fields: dict[str, Any] = {}
    if "spend_limit" in body:
        fields["spend_limit_nano"] = _usd(body, "spend_limit")
    if "expires_at" in body:
        fields["expires_at"] = parse_time(body, "expires_at")
    if "name" in body:
        fields["name"] = str(body["name"])
    fields.update(_key_limits(body))
    unknown = set(body) - {"spend_limit", "expires_at", "name", *_KEY_LIMITS}
    if unknown:
        raise errors.invalid(f"Unknown fields: {', '.join(sorted(unknown))}.")
    if "spend_reset" in fields:  # the key's spend this period is summed from the ledger
        await gw.ledger.settled()
    return (await gw.accounts.update_key(params["key_id"], **fields)).public()


_KEY_LIMITS = ("spend_reset", "rpm_limit", "tpm_limit", "concurrency_limit")


def _key_limits(body: dict[str, Any]) -> dict[str, Any]:
    """The optional per-key limits present in the body, validated."""
    fields: dict[str, Any] = {}
    if "spend_reset" in body:
        if body["spend_reset"] not in SPEND_RESETS:
            raise errors.invalid(f"'spend_reset' must be one of {', '.join(SPEND_RESETS)}.", param="spend_reset")
        fields["spend_reset"] = body["spend_reset"]
    for name in ("rpm_limit", "tpm_limit", "concurrency_limit"):
        if name in body:
            fields[name] = _int_or_none(body, name)
    return fields


def status_setter(status: str) -> Handler:
    """The operation that suspends, reactivates or revokes the key `params["key_id"]`."""
    async def handler(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
        return (await gw.accounts.set_key_status(params["key_id"], status)).public()

    return handler


async def list_usage(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    try:
        limit = min(int(params.get("limit", "100")), 10_000)
    except ValueError:
        raise errors.invalid("'limit' must be an integer.", param="limit") from None
    await gw.ledger.settled()
    events = await gw.accounts.store.list_usage(params.get("org_id"), params.get("key_id"), limit)
    return {"object": "list", "data": [e.public() for e in events]}


async def get_maintenance(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    m = gw.maintenance
    return {"active": m.active, "until": m.until if m.active else None, "message": m.message}


async def set_maintenance(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    until = parse_time(body, "until")
    if until is not None and until <= gw.clock.time():
        raise errors.invalid("'until' must be in the future (or null to end maintenance).", param="until")
    gw.maintenance.until = until
    if isinstance(body.get("message"), str):
        gw.maintenance.message = body["message"]
    await save_maintenance(gw.accounts.store, gw.maintenance)  # survives a restart, reaches every replica
    return await get_maintenance(gw, body, params)


async def list_backends(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    """Every backend: state (healthy, ejected, down), requests in flight, latency, last error."""
    r = gw.router.routing
    routing = {"affinity": r.affinity, "affinity_balance": r.affinity_balance, "retries": r.retries,
               "queue_timeout_s": r.queue_timeout_s, "eject_after": r.eject_after,
               "health_interval_s": gw.router.health_interval_s}
    return {"object": "list", "data": gw.router.status(), "routing": routing}


async def advance_clock(gw: Gateway, body: dict[str, Any], params: Params) -> Any:
    """Test-only (KILN_TEST_CLOCK=1): move the gateway's clock forward."""
    seconds = body.get("seconds")
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
        raise errors.invalid("'seconds' must be a non-negative number.", param="seconds")
    gw.clock.advance(float(seconds))
    return {"offset_s": gw.clock.offset, "time": gw.clock.time()}


def endpoint(handler: Handler, status: int = 200) -> Callable[[Request], Awaitable[Response]]:
    """An HTTP endpoint for an admin operation: the admin credential, the JSON body, errors in
    OpenAI's shape; a Response the operation returns goes out as it is (CSV)."""

    async def run(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        try:
            token, _ = bearer_token(request.headers.get("authorization"), None)
            if token is None or not gw.accounts.is_admin(token):
                raise errors.unauthorized("An admin credential is required (Authorization: Bearer <admin key>).")
            body: dict[str, Any] = {}
            if request.method in ("POST", "PATCH", "PUT"):
                raw = await read_body(request, ADMIN_MAX_BODY_BYTES, gw.settings.body_timeout_s)
                if raw:
                    try:
                        body = orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        raise errors.invalid("The request body is not valid JSON.") from None
                    if not isinstance(body, dict):
                        raise errors.invalid("The request body must be a JSON object.")
            params = {**request.query_params, **request.path_params}
            try:
                result = await handler(gw, body, params)
            except GatewayError as err:
                if err.status != 404 or not gw.accounts.store.shared:
                    raise
                # Another process may have made it a moment ago (before its notice arrived here):
                # take the database's view, then try once more. Every 404 comes before any write.
                await gw.accounts.refresh()
                result = await handler(gw, body, params)
            return result if isinstance(result, Response) else _json(result, status)
        except GatewayError as err:
            reply = openai_error(err)  # with the error's headers (a 413's Connection: close)
            return Response(reply.body, status_code=reply.status, media_type=reply.media_type,
                            headers=reply.headers)

    return run


routes = [
    Route("/admin/v1/orgs", endpoint(list_orgs), methods=["GET"]),
    Route("/admin/v1/orgs", endpoint(create_org, 201), methods=["POST"]),
    Route("/admin/v1/orgs/{org_id}", endpoint(get_org), methods=["GET"]),
    Route("/admin/v1/orgs/{org_id}", endpoint(update_org), methods=["PATCH"]),
    Route("/admin/v1/orgs/{org_id}/credits", endpoint(add_credits), methods=["POST"]),
    Route("/admin/v1/projects", endpoint(list_projects), methods=["GET"]),
    Route("/admin/v1/projects", endpoint(create_project, 201), methods=["POST"]),
    Route("/admin/v1/keys", endpoint(list_keys), methods=["GET"]),
    Route("/admin/v1/keys", endpoint(create_key, 201), methods=["POST"]),
    Route("/admin/v1/keys/{key_id}", endpoint(update_key), methods=["PATCH"]),
    Route("/admin/v1/keys/{key_id}/suspend", endpoint(status_setter("suspended")), methods=["POST"]),
    Route("/admin/v1/keys/{key_id}/reactivate", endpoint(status_setter("active")), methods=["POST"]),
    Route("/admin/v1/keys/{key_id}/revoke", endpoint(status_setter("revoked")), methods=["POST"]),
    Route("/admin/v1/usage", endpoint(list_usage), methods=["GET"]),
    Route("/admin/v1/maintenance", endpoint(get_maintenance), methods=["GET"]),
    Route("/admin/v1/maintenance", endpoint(set_maintenance), methods=["PUT"]),
    Route("/admin/v1/backends", endpoint(list_backends), methods=["GET"]),
]
test_routes = [Route("/admin/v1/clock", endpoint(advance_clock), methods=["POST"])]

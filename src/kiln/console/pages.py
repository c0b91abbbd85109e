"""The console's pages (GET) and actions (POST, then a redirect), server-rendered with Jinja2.

Every page needs a session (else a redirect to sign-in); every action needs the session's
CSRF token too. Actions call the admin API's own operations (kiln.admin, kiln.usage) with
the form's fields as the body, so the console validates and stores exactly as the API
does; a refused action shows the same page again with the API's message and status.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from functools import cache
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from kiln import admin, usage
from kiln.console import auth
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.money import nano_to_usd_str, usd_to_nano
from kiln.core.records import SPEND_RESETS
from kiln.pipeline import Gateway

if TYPE_CHECKING:
    from jinja2 import Environment


@cache
def templates() -> Environment:
    """The console's templates, loaded on its first page: a gateway whose console nobody opens
    does not carry Jinja2 (about 2 MiB in every worker)."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    env = Environment(loader=PackageLoader("kiln.console", "templates"), autoescape=select_autoescape(),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["when"] = lambda ts: "-" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC")
    env.filters["dash"] = lambda value: "-" if value is None or value == "" else value
    env.filters["iso_minute"] = lambda ts: "" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime(
        "%Y-%m-%dT%H:%M")  # what <input type="datetime-local"> shows, in UTC
    return env

HEADERS = {
    "Cache-Control": "no-store",  # pages carry balances, and once a key's secret
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:;"
                               " form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
DONE = {
    "org_created": "Organisation created.", "org_updated": "Budget and limits saved.",
    "credits_added": "Credits added.", "project_created": "Project created.", "key_updated": "Key saved.",
    "suspended": "Key suspended.", "active": "Key reactivated.", "revoked": "Key revoked.",
    "maintenance": "Maintenance updated.",
}

Page = Callable[..., Awaitable[Response]]


def render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    session = auth.current(request)
    html = templates().get_template(template).render(
        csrf=session.csrf if session else "", path=request.url.path,
        done=DONE.get(request.query_params.get("done", "")), **context)
    return HTMLResponse(html, status, headers=HEADERS)


def see(url: str, done: str | None = None) -> RedirectResponse:
    return RedirectResponse(url + (f"{'&' if '?' in url else '?'}done={done}" if done else ""), 303, headers=HEADERS)


def view(page: Page) -> Callable[[Request], Awaitable[Response]]:
    """A GET page: signed in, or off to the sign-in page."""

    async def endpoint(request: Request) -> Response:
        if auth.current(request) is None:
            return see("/console/login")
        return await page(request, request.app.state.gateway)

    return endpoint


def action(do: Callable[[Request, Gateway, dict[str, str]], Awaitable[Response]],
           fallback: Page) -> Callable[[Request], Awaitable[Response]]:
    """A POST: signed in, same origin, the session's CSRF token; on a refusal, `fallback` again."""

    async def endpoint(request: Request) -> Response:
        session = auth.current(request)
        if session is None:
            return see("/console/login")
        form = await auth.read_form(request)
        if not auth.same_origin(request) or form is None or not auth.token_ok(session.csrf, form):
            return render(request, "refused.html", 403, reason="The form's security token is missing or wrong. "
                          "Reload the page and try again.")
        gw = request.app.state.gateway
        try:
            return await do(request, gw, form)
        except GatewayError as err:
            return await fallback(request, gw, error=err.message, status=err.status)

    return endpoint


def body(form: dict[str, str], **kinds: str) -> dict[str, Any]:
    """Form fields as an admin API body: `kinds` maps each field to text, int, usd or time;
    an empty field is null (no limit, no expiry)."""
    out: dict[str, Any] = {}
    for name, kind in kinds.items():
        if name not in form:
            continue
        value = form[name].strip()
        if not value:
            out[name] = None
        elif kind == "int":
            try:
                out[name] = int(value)
            except ValueError:
                raise errors.invalid(f"'{name}' must be a whole number.", param=name) from None
        else:
            out[name] = value  # usd and time: the API parses the text (a time without offset is UTC)
    return out


LIMITS = {"rpm_limit": "int", "tpm_limit": "int", "concurrency_limit": "int"}


# -- organisations and projects ---------------------------------------------------------------


async def orgs(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    data = (await admin.list_orgs(gw, {}, {}))["data"]
    return render(request, "orgs.html", status, orgs=sorted(data, key=lambda o: o["name"]), error=error)


async def create_org(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    org = await admin.create_org(gw, body(form, name="text", credits="usd", monthly_budget="usd", **LIMITS), {})
    return see(f"/console/orgs/{org['id']}", "org_created")


async def org(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    params = {"org_id": request.path_params["org_id"]}
    try:
        detail = await admin.get_org(gw, {}, params)
    except GatewayError as err:
        return render(request, "refused.html", err.status, reason=err.message)
    projects = (await admin.list_projects(gw, {}, params))["data"]
    return render(request, "org.html", status, org=detail, projects=projects, error=error)


async def update_org(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    params = {"org_id": request.path_params["org_id"]}
    await admin.update_org(gw, body(form, monthly_budget="usd", **LIMITS), params)
    return see(f"/console/orgs/{params['org_id']}", "org_updated")


async def add_credits(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    params = {"org_id": request.path_params["org_id"]}
    await admin.add_credits(gw, body(form, amount="usd", note="text"), params)
    return see(f"/console/orgs/{params['org_id']}", "credits_added")


async def projects(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    data = (await admin.list_projects(gw, {}, {}))["data"]
    names = {o.id: o.name for o in gw.accounts.orgs.values()}
    rows = sorted(({**p, "org_name": names.get(p["org_id"], "?")} for p in data),
                  key=lambda p: (p["org_name"], p["name"]))
    return render(request, "projects.html", status, projects=rows, orgs=sorted(names.items(), key=lambda o: o[1]),
                  error=error, org_id=request.query_params.get("org_id", ""))


async def create_project(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    project = await admin.create_project(gw, body(form, org_id="text", name="text"), {})
    return see(f"/console/keys?project_id={project['id']}", "project_created")


# -- keys ----------------------------------------------------------------------------------------


def _project_choices(gw: Gateway) -> list[tuple[str, str]]:
    orgs_by_id = gw.accounts.orgs
    choices = [(p.id, f"{orgs_by_id[p.org_id].name} / {p.name}" if p.org_id in orgs_by_id else p.name)
               for p in gw.accounts.projects.values()]
    return sorted(choices, key=lambda c: c[1])


async def keys(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    project_id = request.query_params.get("project_id") or None
    data = (await admin.list_keys(gw, {}, {"project_id": project_id} if project_id else {}))["data"]
    choices = _project_choices(gw)
    names = dict(choices)
    rows = sorted(({**k, "project": names.get(k["project_id"], "?")} for k in data),
                  key=lambda k: (k["project"], k["created_at"]))
    return render(request, "keys.html", status, keys=rows, projects=choices, project_id=project_id or "",
                  resets=SPEND_RESETS, error=error)


async def create_key(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    fields = body(form, project_id="text", name="text", spend_limit="usd", expires_at="time", **LIMITS)
    if form.get("spend_reset"):
        fields["spend_reset"] = form["spend_reset"]
    fields["name"] = fields.get("name") or ""
    created = await admin.create_key(gw, fields, {})
    # Shown on this response only: no redirect, no-store, never in a URL.
    return render(request, "key_created.html", 201, key=created)


async def key(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    try:
        found = gw.accounts.key(request.path_params["key_id"]).public()
    except GatewayError as err:
        return render(request, "refused.html", err.status, reason=err.message)
    return render(request, "key.html", status, key=found, project=dict(_project_choices(gw)).get(found["project_id"]),
                  resets=SPEND_RESETS, error=error)


async def update_key(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    params = {"key_id": request.path_params["key_id"]}
    fields = body(form, name="text", spend_limit="usd", expires_at="time", **LIMITS)
    fields["name"] = fields.get("name") or ""
    if form.get("spend_reset"):
        fields["spend_reset"] = form["spend_reset"]
    await admin.update_key(gw, fields, params)
    return see(f"/console/keys/{params['key_id']}", "key_updated")


def key_status(status: str) -> Callable[[Request, Gateway, dict[str, str]], Awaitable[Response]]:
    async def do(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
        changed = await admin.status_setter(status)(gw, {}, {"key_id": request.path_params["key_id"]})
        back = form.get("back", "")
        return see(back if back.startswith("/console/") else f"/console/keys?project_id={changed['project_id']}",
                   status)

    return do


# -- usage, backends, maintenance ----------------------------------------------------------------


async def usage_page(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    q = request.query_params
    try:
        days = min(max(int(q.get("days", "30")), 1), 366)
    except ValueError:
        days = 30
    org_id = q.get("org_id", "")
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    first = today - timedelta(days=days - 1)
    params = {"by": "day,model", "since": str(first.timestamp()), "org_id": org_id}
    rows = (await usage.summary(gw, {}, params))["data"]
    dates = [(first + timedelta(days=i)).strftime("%Y-%m-%d") for i in range(days)]
    return render(request, "usage.html", status, error=error, days=days, org_id=org_id,
                  orgs=sorted(((o.id, o.name) for o in gw.accounts.orgs.values()), key=lambda o: o[1]),
                  chart=_chart(dates, rows), by_model=_totals(rows, "model"), by_day=_totals(rows, "day"))


def _chart(dates: list[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-day series for uPlot: every day of the range, zeros where nothing was used."""
    index = {d: i for i, d in enumerate(dates)}
    models = sorted({r["model"] for r in rows})
    requests = [0] * len(dates)
    cost = [0.0] * len(dates)
    by_model = {m: [0.0] * len(dates) for m in models}
    for r in rows:
        i = index.get(r["day"])
        if i is not None:
            requests[i] += r["requests"]
            cost[i] += float(Decimal(r["cost"]))
            by_model[r["model"]][i] += float(Decimal(r["cost"]))
    x = [datetime.strptime(d, "%Y-%m-%d").replace(tzinfo=timezone.utc).timestamp() for d in dates]
    return {"x": x, "requests": requests, "cost": cost, "models": models, "cost_by_model": by_model}


def _totals(rows: list[dict[str, Any]], by: str) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = out.setdefault(r[by], {by: r[by], "requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                   "cost_nano": 0})
        t["requests"] += r["requests"]
        t["prompt_tokens"] += r["prompt_tokens"]
        t["completion_tokens"] += r["completion_tokens"]
        t["cost_nano"] += usd_to_nano(r["cost"])
    return [{**t, "cost": nano_to_usd_str(t.pop("cost_nano"))} for _, t in sorted(out.items())]


async def backends(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    models = [{
        "id": m.id, "aliases": m.aliases, "available": m.available, "prices": m.prices, "simulated": m.simulated,
        "context_window": m.context_window,
        "backends": [{"url": b.url, "model": b.model, "weight": b.weight, **b.state.view()} for b in m.backends],
    } for m in gw.catalog.models]
    return render(request, "backends.html", status, models=models, in_flight=gw.in_flight,
                  maintenance=await admin.get_maintenance(gw, {}, {}))


async def maintenance(request: Request, gw: Gateway, error: str | None = None, status: int = 200) -> Response:
    return render(request, "maintenance.html", status, error=error,
                  state=await admin.get_maintenance(gw, {}, {}))


async def set_maintenance(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    fields = body(form, until="time", message="text")
    if fields.get("until") is None:
        raise errors.invalid("Give the time maintenance ends (UTC).", param="until")
    if not fields.get("message"):
        fields.pop("message", None)
    await admin.set_maintenance(gw, fields, {})
    return see("/console/maintenance", "maintenance")


async def end_maintenance(request: Request, gw: Gateway, form: dict[str, str]) -> Response:
    await admin.set_maintenance(gw, {"until": None}, {})
    return see("/console/maintenance", "maintenance")

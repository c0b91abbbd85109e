"""The web console at /console: organisations, projects, keys, usage charts, backends and
maintenance, for whoever holds the admin credential.

Server-rendered HTML (Jinja2, autoescaped) with a little JavaScript; every asset ships in
this package (static/, including uPlot for the charts), so it works with no network.
`routes` is all an app mounts.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from kiln.console import auth, pages
from kiln.console.pages import action, render, see, view

STATIC = Path(__file__).parent / "static"
LOGIN_FORM_S = 600  # how long a sign-in form stays good


async def index(request: Request) -> Response:
    return see("/console/orgs" if auth.current(request) else "/console/login")


def _login_form(request: Request, status: int = 200, error: str | None = None) -> Response:
    token = secrets.token_urlsafe(32)
    response = render(request, "login.html", status, login_csrf=token, error=error)
    auth.set_cookie(request, response, auth.LOGIN_COOKIE, token, LOGIN_FORM_S, path="/console/login")
    return response


async def login_page(request: Request) -> Response:
    if auth.current(request) is not None:
        return see("/console/orgs")
    return _login_form(request)


async def login(request: Request) -> Response:
    form = await auth.read_form(request)
    expected = request.cookies.get(auth.LOGIN_COOKIE, "")
    if form is None or not auth.same_origin(request) or not expected or not auth.token_ok(expected, form):
        return render(request, "refused.html", 403, reason="The sign-in form expired or did not come from this "
                      "console. Open the sign-in page again.")
    if not request.app.state.gateway.accounts.is_admin(form.get("admin_key", "").strip()):
        return _login_form(request, 401, "That is not the admin credential.")
    session = auth.sessions(request).create()
    response = see("/console/orgs")
    auth.set_cookie(request, response, auth.COOKIE, session.id, auth.LIFETIME_S)
    auth.clear_cookie(request, response, auth.LOGIN_COOKIE, path="/console/login")
    return response


async def logout(request: Request) -> Response:
    session = auth.current(request)
    if session is None:
        return see("/console/login")
    form = await auth.read_form(request)
    if form is None or not auth.same_origin(request) or not auth.token_ok(session.csrf, form):
        return render(request, "refused.html", 403, reason="The form's security token is missing or wrong.")
    auth.sessions(request).end(session.id)
    response = see("/console/login")
    auth.clear_cookie(request, response, auth.COOKIE)
    return response


GET, POST = ["GET"], ["POST"]
routes: list[BaseRoute] = [
    Route("/console", index, methods=GET),
    Route("/console/login", login_page, methods=GET),
    Route("/console/login", login, methods=POST),
    Route("/console/logout", logout, methods=POST),
    Route("/console/orgs", view(pages.orgs), methods=GET),
    Route("/console/orgs", action(pages.create_org, pages.orgs), methods=POST),
    Route("/console/orgs/{org_id}", view(pages.org), methods=GET),
    Route("/console/orgs/{org_id}", action(pages.update_org, pages.org), methods=POST),
    Route("/console/orgs/{org_id}/credits", action(pages.add_credits, pages.org), methods=POST),
    Route("/console/projects", view(pages.projects), methods=GET),
    Route("/console/projects", action(pages.create_project, pages.projects), methods=POST),
    Route("/console/keys", view(pages.keys), methods=GET),
    Route("/console/keys", action(pages.create_key, pages.keys), methods=POST),
    Route("/console/keys/{key_id}", view(pages.key), methods=GET),
    Route("/console/keys/{key_id}", action(pages.update_key, pages.key), methods=POST),
    *(Route(f"/console/keys/{{key_id}}/{verb}", action(pages.key_status(status), pages.keys), methods=POST)
      for verb, status in (("suspend", "suspended"), ("reactivate", "active"), ("revoke", "revoked"))),
    Route("/console/usage", view(pages.usage_page), methods=GET),
    Route("/console/backends", view(pages.backends), methods=GET),
    Route("/console/maintenance", view(pages.maintenance), methods=GET),
    Route("/console/maintenance", action(pages.set_maintenance, pages.maintenance), methods=POST),
    Route("/console/maintenance/end", action(pages.end_maintenance, pages.maintenance), methods=POST),
    Mount("/console/static", StaticFiles(directory=STATIC), name="console-static"),
]

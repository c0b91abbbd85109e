"""Console sign-in: the admin credential buys a session cookie; every form carries a CSRF token.

Sessions live in this process's memory: a restart signs everyone out, and behind several
gateway replicas a browser must stick to one (or sign in on each). The cookie holds only a
random session id (HttpOnly, SameSite=Strict, Secure over HTTPS, Path=/console); the admin
credential itself is never stored. A form's token must match its session's (or, on the
sign-in form, the short-lived cookie set with the form: a double submit), and a POST from
another origin is refused outright.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.responses import Response

COOKIE = "kiln_console"
LOGIN_COOKIE = "kiln_console_login"
PATH = "/console"
LIFETIME_S = 8 * 3600
MAX_SESSIONS = 1000  # the oldest goes first; only a holder of the admin credential can make one
MAX_FORM_BYTES = 64 * 1024


@dataclass(slots=True)
class Session:
    id: str
    csrf: str
    expires: float


@dataclass
class Sessions:
    """The signed-in browsers of this process."""

    by_id: dict[str, Session] = field(default_factory=dict)

    def create(self) -> Session:
        while len(self.by_id) >= MAX_SESSIONS:
            self.by_id.pop(next(iter(self.by_id)))
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), time.monotonic() + LIFETIME_S)
        self.by_id[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        session = self.by_id.get(session_id or "")
        if session is not None and session.expires <= time.monotonic():
            self.by_id.pop(session.id, None)
            return None
        return session

    def end(self, session_id: str) -> None:
        self.by_id.pop(session_id, None)


def sessions(request: Request) -> Sessions:
    state = request.app.state
    if not hasattr(state, "console_sessions"):
        state.console_sessions = Sessions()
    return state.console_sessions  # type: ignore[no-any-return]


def current(request: Request) -> Session | None:
    return sessions(request).get(request.cookies.get(COOKIE))


def set_cookie(request: Request, response: Response, name: str, value: str, max_age: int, path: str = PATH) -> None:
    response.set_cookie(name, value, max_age=max_age, path=path, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")


def clear_cookie(request: Request, response: Response, name: str, path: str = PATH) -> None:
    set_cookie(request, response, name, "", 0, path)


def same_origin(request: Request) -> bool:
    """False for a POST whose Origin names another site (browsers send it on form posts)."""
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.url.netloc}"


def token_ok(expected: str, form: dict[str, str]) -> bool:
    given = form.get("csrf", "")
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


async def read_form(request: Request) -> dict[str, str] | None:
    """An application/x-www-form-urlencoded body as a dict; None when too large or not a form."""
    if not request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    try:
        return dict(parse_qsl(body.decode(), keep_blank_values=True))
    except UnicodeDecodeError:
        return None

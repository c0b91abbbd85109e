"""The web console at /console, in a real browser (Debian's chromium, headless, driven by
Playwright) and over plain HTTP, against a real gateway and the simulator.

The browser walk goes as an operator would: sign in, create an organisation, a project and a
key, use the key with the openai SDK, find the request in the usage chart, suspend the key and
see the next request refused. A screenshot of every page is saved under the test's tmp_path
and checked not to be blank. The HTTP tests pin the session and CSRF rules.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from PIL import Image

from conftest import ADMIN_KEY, Gateway, Sim, catalog_toml, start_gateway, stop

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ["/console/orgs", "/console/projects", "/console/keys", "/console/usage", "/console/backends",
         "/console/maintenance"]


@pytest.fixture(scope="module")
def gw(sim: Sim) -> Iterator[Gateway]:
    """A gateway of its own: these tests switch maintenance on, and sessions live in its memory."""
    g = start_gateway(catalog_toml(sim.url))
    yield g
    stop(g.proc)


def unique(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}"


# -- over HTTP ----------------------------------------------------------------------------------


def _token(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, html[:500]
    return match.group(1)


def signed_in(gw: Gateway) -> tuple[httpx.Client, str]:
    """An HTTP client with a console session, and that session's CSRF token."""
    client = httpx.Client(base_url=gw.url, follow_redirects=False, timeout=30)
    form = client.get("/console/login")
    r = client.post("/console/login", data={"csrf": _token(form.text), "admin_key": ADMIN_KEY})
    assert r.status_code == 303 and r.headers["location"] == "/console/orgs", r.text
    page = client.get("/console/orgs")
    assert page.status_code == 200
    return client, _token(page.text)


def test_pages_need_a_session(gw: Gateway) -> None:
    with httpx.Client(base_url=gw.url, follow_redirects=False, timeout=30) as anonymous:
        for path in ["/console", *PAGES, "/console/keys/key_x", "/console/orgs/org_x"]:
            r = anonymous.get(path)
            assert (r.status_code, r.headers.get("location")) == (303, "/console/login"), path
        for path in ["/console/orgs", "/console/keys", "/console/keys/key_x/suspend", "/console/maintenance",
                     "/console/logout"]:
            r = anonymous.post(path, data={"csrf": "x", "name": "sneaky"})
            assert (r.status_code, r.headers.get("location")) == (303, "/console/login"), path
        assert "sneaky" not in str(gw.admin.get("/orgs").json())
        # the assets need no session, and ship with the package
        js = anonymous.get("/console/static/uplot/uPlot.iife.min.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "uPlot" in js.text
        assert anonymous.get("/console/static/uplot/LICENSE").status_code == 200


def test_a_wrong_admin_key_is_refused(gw: Gateway) -> None:
    tenant = gw.new_key()
    with httpx.Client(base_url=gw.url, follow_redirects=False, timeout=30) as client:
        for wrong in ("sk-kiln-admin-wrong", tenant.key, ""):
            form = client.get("/console/login")
            r = client.post("/console/login", data={"csrf": _token(form.text), "admin_key": wrong})
            assert r.status_code == 401 and "not the admin credential" in r.text
            assert "kiln_console=" not in r.headers.get("set-cookie", "").replace("kiln_console_login", "")
            assert client.get("/console/orgs").status_code == 303


def test_session_cookie_flags_and_security_headers(gw: Gateway) -> None:
    client = httpx.Client(base_url=gw.url, follow_redirects=False, timeout=30)
    form = client.get("/console/login")
    login_cookie = form.headers["set-cookie"]
    assert "HttpOnly" in login_cookie and "SameSite=strict" in login_cookie and "Path=/console/login" in login_cookie
    r = client.post("/console/login", data={"csrf": _token(form.text), "admin_key": ADMIN_KEY})
    [session] = [c for c in r.headers.get_list("set-cookie") if c.startswith("kiln_console=")]
    assert "HttpOnly" in session and "SameSite=strict" in session and "Path=/console" in session
    assert "Max-Age=28800" in session and "Secure" not in session  # plain HTTP here; Secure over HTTPS
    assert ADMIN_KEY not in session
    page = client.get("/console/keys")
    assert page.headers["cache-control"] == "no-store" and page.headers["x-frame-options"] == "DENY"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "script-src 'self'" in page.headers["content-security-policy"]


def test_forms_need_the_csrf_token(gw: Gateway) -> None:
    client, csrf = signed_in(gw)
    name = unique("csrf")
    for data, headers in (({"name": name}, {}), ({"name": name, "csrf": "forged"}, {}),
                          ({"name": name, "csrf": csrf}, {"Origin": "http://evil.example"})):
        r = client.post("/console/orgs", data=data, headers=headers)
        assert r.status_code == 403 and "security token" in r.text
    assert name not in str(gw.admin.get("/orgs").json())
    assert client.post("/console/logout", data={}).status_code == 403  # logout is a form too
    assert client.post("/console/orgs", data={"name": name, "csrf": csrf}).status_code == 303
    assert name in str(gw.admin.get("/orgs").json())
    # the sign-in form: its token must match the cookie set with it
    fresh = httpx.Client(base_url=gw.url, follow_redirects=False, timeout=30)
    assert fresh.post("/console/login", data={"csrf": "x", "admin_key": ADMIN_KEY}).status_code == 403
    fresh.get("/console/login")
    assert fresh.post("/console/login", data={"csrf": "x", "admin_key": ADMIN_KEY}).status_code == 403


def test_logout_ends_the_session(gw: Gateway) -> None:
    client, csrf = signed_in(gw)
    cookie = client.cookies["kiln_console"]
    r = client.post("/console/logout", data={"csrf": csrf})
    assert (r.status_code, r.headers["location"]) == (303, "/console/login")
    assert any(c.startswith('kiln_console=""') and "Max-Age=0" in c for c in r.headers.get_list("set-cookie"))
    # the old cookie is worth nothing now, whoever kept it
    with httpx.Client(base_url=gw.url, cookies={"kiln_console": cookie}, follow_redirects=False) as replay:
        assert replay.get("/console/orgs").headers["location"] == "/console/login"


def test_refusals_show_the_api_message(gw: Gateway) -> None:
    client, csrf = signed_in(gw)
    name = unique("dup")
    assert client.post("/console/orgs", data={"csrf": csrf, "name": name}).status_code == 303
    again = client.post("/console/orgs", data={"csrf": csrf, "name": name})
    assert again.status_code == 409 and "exists" in again.text and 'role="alert"' in again.text
    bad = client.post("/console/orgs", data={"csrf": csrf, "name": unique("bad"), "credits": "ten"})
    assert bad.status_code == 400 and "credits" in bad.text
    limit = client.post("/console/orgs", data={"csrf": csrf, "name": unique("bad"), "rpm_limit": "1.5"})
    assert limit.status_code == 400 and "whole number" in limit.text
    assert client.get("/console/orgs/org_nope").status_code == 404
    evil = unique("<script>alert(1)</script>")
    assert client.post("/console/orgs", data={"csrf": csrf, "name": evil}).status_code == 303
    listing = client.get("/console/orgs").text
    assert evil not in listing and "&lt;script&gt;alert(1)&lt;/script&gt;" in listing  # escaped


# -- in the browser -------------------------------------------------------------------------------


def assert_not_blank(path: Path) -> None:
    """A screenshot that shows something: many colours, none covering almost everything."""
    with Image.open(path) as image:
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20) or []
        assert rgb.width >= 800 and rgb.height >= 400, path
        assert len(colours) >= 16, f"{path.name}: only {len(colours)} colours"
        assert max(n for n, _ in colours) < 0.97 * rgb.width * rgb.height, f"{path.name} is nearly one colour"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (.ci/services does)")
    with playwright_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900})
        context.set_default_timeout(30_000)
        yield context
        context.close()


def test_console_in_a_browser(gw: Gateway, browser: Any, tmp_path: Path) -> None:
    page = browser.new_page()
    outside: list[str] = []
    page.on("request", lambda req: outside.append(req.url) if not req.url.startswith(gw.url) else None)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    shots: list[Path] = []

    def shot(name: str) -> None:
        path = tmp_path / f"{len(shots):02d}-{name}.png"
        page.screenshot(path=str(path), full_page=True)
        shots.append(path)

    # Sign in: a wrong credential first.
    page.goto(gw.url + "/console")
    assert page.url == gw.url + "/console/login"
    shot("login")
    page.fill("input[name=admin_key]", "sk-kiln-admin-not-this-one")
    page.click("button[type=submit]")
    assert "not the admin credential" in page.inner_text("[role=alert]")
    page.fill("input[name=admin_key]", ADMIN_KEY)
    page.click("button[type=submit]")
    page.wait_for_url(gw.url + "/console/orgs")
    [cookie] = [c for c in browser.cookies() if c["name"] == "kiln_console"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert page.evaluate("document.cookie") == ""  # no script can read it

    # An organisation, with credits, more credits and limits.
    org_name = unique("acme")
    page.fill("#create-org input[name=name]", org_name)
    page.fill("#create-org input[name=credits]", "5")
    page.click("#create-org button")
    page.wait_for_url(re.compile(r".*/console/orgs/org_\w+\?done=org_created"))
    org_id = page.url.split("/console/orgs/")[1].split("?")[0]
    assert page.inner_text("#org-credits") == "5 USD"
    page.fill("#add-credits input[name=amount]", "2.5")
    page.fill("#add-credits input[name=note]", "browser top-up")
    page.click("#add-credits button")
    page.wait_for_url(re.compile(r".*done=credits_added"))
    assert page.inner_text("#org-credits") == "7.5 USD"
    page.fill("#org-limits input[name=monthly_budget]", "40")
    page.fill("#org-limits input[name=concurrency_limit]", "6")
    page.click("#org-limits button")
    page.wait_for_url(re.compile(r".*done=org_updated"))
    shown = gw.admin.get(f"/orgs/{org_id}").json()
    assert (shown["credits"], shown["monthly_budget"], shown["concurrency_limit"]) == ("7.5", "40", 6)
    shot("organisation")
    page.goto(gw.url + "/console/orgs")
    assert org_name in page.inner_text("#orgs")
    shot("organisations")

    # A project, then a key: its secret is on the page once.
    page.goto(gw.url + f"/console/projects?org_id={org_id}")
    page.fill("#create-project input[name=name]", "web")
    page.click("#create-project button")
    page.wait_for_url(re.compile(r".*/console/keys\?project_id=proj_\w+&done=project_created"))
    project_id = page.url.split("project_id=")[1].split("&")[0]
    page.goto(gw.url + "/console/projects")
    assert "web" in page.inner_text("#projects")
    shot("projects")
    page.goto(gw.url + f"/console/keys?project_id={project_id}")
    page.fill("#create-key input[name=name]", "browser")
    page.fill("#create-key input[name=spend_limit]", "3")
    page.click("#create-key button")
    secret = page.inner_text("#new-secret").strip()
    assert secret.startswith("sk-kiln-") and len(secret) > 40
    shot("key-created")
    [key] = [k for k in gw.admin.get("/keys", params={"project_id": project_id}).json()["data"]]
    assert key["name"] == "browser" and key["spend_limit"] == "3"
    page.goto(gw.url + f"/console/keys?project_id={project_id}")
    assert secret not in page.content()  # never shown again

    # The key works with the openai SDK, and the request shows in the usage chart.
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
    reply = client.chat.completions.create(model="qwen3-32b", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=12)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    page.goto(gw.url + f"/console/usage?org_id={org_id}&days=7")
    page.wait_for_function("window.kilnCharts && window.kilnCharts.daily")
    assert page.inner_text("#usage-by-model tr[data-model=qwen3-32b] .requests") == "1"
    daily = page.evaluate("window.kilnCharts.daily.data.map(s => Array.from(s))")
    assert len(daily[0]) == 7 and daily[1][-1] == 1 and sum(daily[1]) == 1  # today, one request
    assert daily[2][-1] > 0  # and what it cost
    by_model = page.evaluate("window.kilnCharts.models.series.map(s => s.label)")
    assert by_model[1:] == ["qwen3-32b"]
    chart = tmp_path / "chart-daily.png"
    page.locator("#chart-daily").screenshot(path=str(chart))
    with Image.open(chart) as image:
        assert len(image.convert("RGB").getcolors(1 << 20) or []) >= 8  # axes, bars and a line were drawn
    shot("usage")

    # Suspend the key in the console: the next request is refused.
    page.goto(gw.url + f"/console/keys?project_id={project_id}")
    page.click(f"button.suspend[data-key={key['id']}]")
    page.wait_for_url(re.compile(r".*done=suspended"))
    assert page.inner_text(f"tr[data-key={key['id']}] .status") == "suspended"
    shot("keys")
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model="qwen3-32b", messages=[{"role": "user", "content": "again"}])
    assert refused.value.status_code == 403

    # Limits and expiry on the key's page; reactivate; revoke (after a confirmation).
    page.goto(gw.url + f"/console/keys/{key['id']}")
    page.fill("#key-limits input[name=spend_limit]", "1.25")
    page.select_option("#key-limits select[name=spend_reset]", "daily")
    page.fill("#key-limits input[name=expires_at]", "2099-01-01T00:00")
    page.fill("#key-limits input[name=rpm_limit]", "30")
    page.click("#key-limits button")
    page.wait_for_url(re.compile(r".*done=key_updated"))
    k = [k for k in gw.admin.get("/keys", params={"project_id": project_id}).json()["data"]][0]
    assert (k["spend_limit"], k["spend_reset"], k["expires_at"], k["rpm_limit"]) == ("1.25", "daily", 4070908800, 30)
    shot("key")
    page.click("button.reactivate")
    page.wait_for_url(re.compile(r".*done=active"))
    assert page.inner_text("#key-status") == "active"
    assert client.chat.completions.create(model="qwen3-32b", messages=[{"role": "user", "content": "ok"}],
                                          max_tokens=4).choices
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("button.revoke")
    page.wait_for_url(re.compile(r".*done=revoked"))
    assert page.inner_text("#key-status") == "revoked"

    # Backends and their health, as the router knows them.
    page.goto(gw.url + "/console/backends")
    health = {row.get_attribute("data-model"): row.inner_text() for row in page.query_selector_all("#backends tbody tr")}
    assert "up" in health["qwen3-32b"] and "down" in health["offline-model"]
    shot("backends")

    # Maintenance on (requests get 503), then off.
    page.goto(gw.url + "/console/maintenance")
    page.fill("#maintenance-on input[name=until]", "2099-12-01T06:00")
    page.fill("#maintenance-on input[name=message]", "Moving racks.")
    page.click("#maintenance-on button")
    page.wait_for_url(re.compile(r".*done=maintenance"))
    assert "On" in page.inner_text("#maintenance-state")
    shot("maintenance")
    other = gw.new_key()
    r = other.http().post("/v1/chat/completions", json={"model": "qwen3-32b", "messages": [{"role": "user",
                                                                                          "content": "hi"}]})
    assert r.status_code == 503 and "Moving racks." in r.json()["error"]["message"]
    page.click("#maintenance-off button")
    page.wait_for_url(re.compile(r".*done=maintenance"))
    assert "Off" in page.inner_text("#maintenance-state")

    # Sign out: the console asks for the credential again.
    page.click("#logout")
    page.wait_for_url(gw.url + "/console/login")
    page.goto(gw.url + "/console/keys")
    assert page.url == gw.url + "/console/login"

    assert not outside, f"the console fetched from elsewhere: {outside}"
    assert not errors, f"JavaScript errors: {errors}"
    assert len(shots) == 10
    for path in shots:
        assert_not_blank(path)

"""The admin API (/admin/v1), maintenance mode, and the credit and rate limits of core/admission.py.

Real gateway, real simulator, HTTP only. Every test makes its own
organisation; the maintenance tests run on a private gateway so that the
session gateway is never put in maintenance under other tests.
"""

from __future__ import annotations

import threading
import time
from decimal import Decimal
from email.utils import parsedate_to_datetime
from typing import Any, Iterator

import httpx
import openai
import pytest

from conftest import ADMIN_KEY, Gateway, Sim, Tenant, catalog_toml, start_gateway, stop

CHAT = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 20}


def unique(prefix: str = "org") -> str:
    return f"{prefix}-{time.monotonic_ns()}"


def chat(t: Tenant, **extra: Any) -> httpx.Response:
    with t.http() as c:
        return c.post("/v1/chat/completions", json={**CHAT, **extra})


def assert_error(r: httpx.Response, status: int, code: str | None = None, type_: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"].strip()
    if code is not None:
        assert err["code"] == code, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


def make_org(gw: Gateway, **fields: Any) -> dict[str, Any]:
    r = gw.admin.post("/orgs", json={"name": unique(), **fields})
    assert r.status_code == 201, r.text
    return r.json()


def tenant_with(gw: Gateway, credits: str = "10", key_fields: dict[str, Any] | None = None,
                **org_fields: Any) -> Tenant:
    org = make_org(gw, credits=credits, **org_fields)
    project = gw.admin.post("/projects", json={"org_id": org["id"], "name": "p"})
    assert project.status_code == 201, project.text
    key = gw.admin.post("/keys", json={"project_id": project.json()["id"], "name": "k", **(key_fields or {})})
    assert key.status_code == 201, key.text
    return Tenant(gw, org["id"], project.json()["id"], key.json()["id"], key.json()["key"])


def assert_not_billed(t: Tenant, events: int, credits: Decimal) -> None:
    assert len(t.usage()) == events
    org = t.org()
    assert org["usage_events"] == events
    assert Decimal(org["credits"]) == credits


# -- the admin credential -------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer sk-kiln-admin-wrong"}, {"Authorization": f"Basic {ADMIN_KEY}"},
     {"x-api-key": ADMIN_KEY}],
    ids=["none", "wrong", "basic", "x-api-key"],
)
@pytest.mark.parametrize(
    "method,path,body",
    [("GET", "/orgs", None), ("POST", "/orgs", {"name": "should-not-exist"}), ("GET", "/usage", None),
     ("GET", "/keys", None), ("PUT", "/maintenance", {"until": None})],
)
def test_admin_requires_the_admin_credential(
    gateway: Gateway, headers: dict[str, str], method: str, path: str, body: Any
) -> None:
    with httpx.Client(base_url=gateway.url + "/admin/v1", timeout=30) as c:
        r = c.request(method, path, json=body, headers=headers)
    assert_error(r, 401, type_="authentication_error")
    names = [o["name"] for o in gateway.admin.get("/orgs").json()["data"]]
    assert "should-not-exist" not in names


def test_an_api_key_is_not_an_admin_credential(tenant: Tenant) -> None:
    with tenant.http() as c:
        assert_error(c.get("/admin/v1/orgs"), 401)
        assert_error(c.post("/admin/v1/orgs", json={"name": unique()}), 401)
        assert_error(c.post(f"/admin/v1/orgs/{tenant.org_id}/credits", json={"amount": "100"}), 401)
        assert_error(c.post(f"/admin/v1/keys/{tenant.key_id}/reactivate"), 401)
    assert Decimal(tenant.org()["credits"]) == 10


# -- organisations, projects, keys ------------------------------------------------------


def test_create_and_list_orgs(gateway: Gateway) -> None:
    name = unique()
    r = gateway.admin.post("/orgs", json={"name": name, "credits": "12.5", "monthly_budget": "7",
                                          "rpm_limit": 30, "concurrency_limit": 3})
    assert r.status_code == 201, r.text
    org = r.json()
    assert org["id"].startswith("org_")
    assert org["name"] == name
    assert Decimal(org["credits"]) == Decimal("12.5")
    assert Decimal(org["monthly_budget"]) == 7
    assert org["rpm_limit"] == 30 and org["concurrency_limit"] == 3 and org["tpm_limit"] is None
    listed = {o["id"]: o for o in gateway.admin.get("/orgs").json()["data"]}
    assert listed[org["id"]]["name"] == name
    detail = gateway.admin.get(f"/orgs/{org['id']}").json()
    assert Decimal(detail["credits"]) == Decimal("12.5")
    assert Decimal(detail["total_granted"]) == Decimal("12.5")
    assert Decimal(detail["total_spend"]) == 0
    assert detail["usage_events"] == 0


def test_amounts_accept_numbers_and_are_exact(gateway: Gateway) -> None:
    org = make_org(gateway, credits=0.1)
    r = gateway.admin.post(f"/orgs/{org['id']}/credits", json={"amount": 0.2})
    assert r.status_code == 200, r.text
    # 0.1 + 0.2 in floats is 0.30000000000000004; in exact money it is 0.3.
    assert r.json()["credits"] == "0.3"


def test_create_and_list_projects(gateway: Gateway) -> None:
    org = make_org(gateway)
    a = gateway.admin.post("/projects", json={"org_id": org["id"], "name": "web"})
    b = gateway.admin.post("/projects", json={"org_id": org["id"], "name": "batch"})
    assert a.status_code == b.status_code == 201, (a.text, b.text)
    assert a.json()["id"].startswith("proj_") and a.json()["org_id"] == org["id"]
    listed = gateway.admin.get("/projects", params={"org_id": org["id"]}).json()["data"]
    assert sorted(p["name"] for p in listed) == ["batch", "web"]
    everything = {p["id"] for p in gateway.admin.get("/projects").json()["data"]}
    assert {a.json()["id"], b.json()["id"]} <= everything


def test_duplicate_project_name_in_one_org_is_409(gateway: Gateway) -> None:
    org = make_org(gateway)
    assert gateway.admin.post("/projects", json={"org_id": org["id"], "name": "web"}).status_code == 201
    assert_error(gateway.admin.post("/projects", json={"org_id": org["id"], "name": "web"}), 409)
    other = make_org(gateway)
    assert gateway.admin.post("/projects", json={"org_id": other["id"], "name": "web"}).status_code == 201


def test_create_and_list_keys(gateway: Gateway) -> None:
    t = tenant_with(gateway)
    r = gateway.admin.post("/keys", json={"project_id": t.project_id, "name": "ci", "spend_limit": "5",
                                          "expires_at": "2099-01-01T00:00:00Z"})
    assert r.status_code == 201, r.text
    k = r.json()
    assert k["key"].startswith("sk-kiln-")
    assert k["id"].startswith("key_") and k["project_id"] == t.project_id and k["org_id"] == t.org_id
    assert k["name"] == "ci" and k["status"] == "active"
    assert Decimal(k["spend_limit"]) == 5 and k["expires_at"] == 4070908800
    listed = gateway.admin.get("/keys", params={"project_id": t.project_id}).json()["data"]
    assert {x["id"] for x in listed} == {t.key_id, k["id"]}
    assert all("key" not in x for x in listed)
    by_org = gateway.admin.get("/keys", params={"org_id": t.org_id}).json()["data"]
    assert {x["id"] for x in by_org} == {t.key_id, k["id"]}


def test_suspend_reactivate_revoke_through_the_admin_api(gateway: Gateway) -> None:
    t = tenant_with(gateway)
    assert chat(t).status_code == 200
    r = gateway.admin.post(f"/keys/{t.key_id}/suspend")
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    assert_error(chat(t), 403, type_="permission_error")
    r = gateway.admin.post(f"/keys/{t.key_id}/reactivate")
    assert r.status_code == 200 and r.json()["status"] == "active"
    assert chat(t).status_code == 200
    r = gateway.admin.post(f"/keys/{t.key_id}/revoke")
    assert r.status_code == 200 and r.json()["status"] == "revoked"
    assert_error(chat(t), 403)
    assert_error(gateway.admin.post(f"/keys/{t.key_id}/reactivate"), 409)
    listed = gateway.admin.get("/keys", params={"project_id": t.project_id}).json()["data"]
    assert listed[0]["status"] == "revoked"


def test_add_credits(gateway: Gateway) -> None:
    t = tenant_with(gateway, credits="1")
    r = gateway.admin.post(f"/orgs/{t.org_id}/credits", json={"amount": "2.25", "note": "top-up"})
    assert r.status_code == 200, r.text
    assert Decimal(r.json()["credits"]) == Decimal("3.25")
    org = t.org()
    assert Decimal(org["credits"]) == Decimal("3.25")
    assert Decimal(org["total_granted"]) == Decimal("3.25")


def test_set_monthly_budget_and_limits(gateway: Gateway) -> None:
    org = make_org(gateway, credits="1")
    r = gateway.admin.patch(f"/orgs/{org['id']}", json={"monthly_budget": "4.5", "rpm_limit": 10,
                                                        "tpm_limit": 1000, "concurrency_limit": 2})
    assert r.status_code == 200, r.text
    assert Decimal(r.json()["monthly_budget"]) == Decimal("4.5")
    detail = gateway.admin.get(f"/orgs/{org['id']}").json()
    assert detail["rpm_limit"] == 10 and detail["tpm_limit"] == 1000 and detail["concurrency_limit"] == 2
    r = gateway.admin.patch(f"/orgs/{org['id']}", json={"monthly_budget": None, "rpm_limit": None})
    assert r.status_code == 200
    assert r.json()["monthly_budget"] is None and r.json()["rpm_limit"] is None
    assert r.json()["concurrency_limit"] == 2


def test_set_key_spend_limit_and_expiry(gateway: Gateway) -> None:
    t = tenant_with(gateway)
    r = gateway.admin.patch(f"/keys/{t.key_id}", json={"spend_limit": "0.5", "expires_at": 4102444800,
                                                       "name": "renamed"})
    assert r.status_code == 200, r.text
    k = r.json()
    assert Decimal(k["spend_limit"]) == Decimal("0.5") and k["expires_at"] == 4102444800 and k["name"] == "renamed"
    info = t.http().get("/v1/key").json()
    assert Decimal(info["spend_limit"]) == Decimal("0.5") and info["expires_at"] == 4102444800
    r = gateway.admin.patch(f"/keys/{t.key_id}", json={"spend_limit": None, "expires_at": None})
    assert r.status_code == 200
    assert r.json()["spend_limit"] is None and r.json()["expires_at"] is None


def test_usage_listing_by_key_and_by_org(gateway: Gateway) -> None:
    t = tenant_with(gateway)
    second = gateway.admin.post("/keys", json={"project_id": t.project_id, "name": "b"}).json()
    ids = [chat(t).headers["x-neocloud-generation-id"] for _ in range(3)]
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {second['key']}"}) as c:
        other = c.post("/v1/chat/completions", json=CHAT).headers["x-neocloud-generation-id"]
    by_key = gateway.admin.get("/usage", params={"key_id": t.key_id}).json()
    assert by_key["object"] == "list"
    assert [e["id"] for e in by_key["data"]] == ids[::-1]  # newest first
    by_org = gateway.admin.get("/usage", params={"org_id": t.org_id}).json()["data"]
    assert {e["id"] for e in by_org} == {*ids, other}
    limited = gateway.admin.get("/usage", params={"org_id": t.org_id, "limit": 2}).json()["data"]
    assert len(limited) == 2
    assert_error(gateway.admin.get("/usage", params={"limit": "many"}), 400)
    e = by_key["data"][0]
    for field in ("id", "created_at", "org_id", "project_id", "key_id", "model", "endpoint", "prompt_tokens",
                  "cached_tokens", "completion_tokens", "reasoning_tokens", "cost", "status", "cancelled",
                  "ttft_ms", "duration_ms"):
        assert field in e, field


# -- bad input, unknown ids, conflicts ---------------------------------------------------


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": 42}, "name"),
        ({"name": "x", "monthly_budget": "lots"}, "monthly_budget"),
        ({"name": "x", "monthly_budget": True}, "monthly_budget"),
        ({"name": "x", "rpm_limit": 0}, "rpm_limit"),
        ({"name": "x", "concurrency_limit": "8"}, "concurrency_limit"),
        ({"name": "x", "tpm_limit": -5}, "tpm_limit"),
    ],
)
def test_create_org_bad_input_is_400(gateway: Gateway, body: dict[str, Any], param: str) -> None:
    if body.get("name") == "x":
        body = {**body, "name": unique("bad")}
    err = assert_error(gateway.admin.post("/orgs", json=body), 400, type_="invalid_request_error")
    assert param in err["message"] or err.get("param") == param
    if isinstance(body.get("name"), str) and body["name"]:
        names = [o["name"] for o in gateway.admin.get("/orgs").json()["data"]]
        assert body["name"] not in names, "a rejected create must not create the organisation"


@pytest.mark.parametrize("credits", ["lots", "0.0000000001"])
def test_create_org_with_bad_credits_is_400_and_creates_nothing(gateway: Gateway, credits: Any) -> None:
    name = unique("badcredits")
    err = assert_error(gateway.admin.post("/orgs", json={"name": name, "credits": credits}), 400)
    assert "credits" in err["message"]
    names = [o["name"] for o in gateway.admin.get("/orgs").json()["data"]]
    assert name not in names, "a 400 must not leave a half-created organisation behind"
    # ...so the caller can simply retry with a corrected amount.
    r = gateway.admin.post("/orgs", json={"name": name, "credits": "1"})
    assert r.status_code == 201, r.text


def test_negative_amounts_are_400(gateway: Gateway) -> None:
    """A negative initial grant, budget or spend limit is bad input, not a silently blocked tenant."""
    t = tenant_with(gateway)
    a = gateway.admin
    attempts = {
        "POST /orgs credits": (a.post("/orgs", json={"name": unique("neg"), "credits": "-5"}), "credits"),
        "POST /orgs monthly_budget": (a.post("/orgs", json={"name": unique("neg"), "monthly_budget": "-1"}),
                                      "monthly_budget"),
        "POST /keys spend_limit": (a.post("/keys", json={"project_id": t.project_id, "spend_limit": "-1"}),
                                   "spend_limit"),
        "PATCH /orgs monthly_budget": (a.patch(f"/orgs/{t.org_id}", json={"monthly_budget": "-3"}),
                                       "monthly_budget"),
        "PATCH /keys spend_limit": (a.patch(f"/keys/{t.key_id}", json={"spend_limit": "-0.5"}), "spend_limit"),
    }
    accepted = [what for what, (r, _) in attempts.items() if r.status_code != 400]
    assert not accepted, f"negative amounts accepted by: {accepted}"
    for r, param in attempts.values():
        assert param in r.json()["error"]["message"]
    assert chat(t).status_code == 200, "a rejected change must leave the tenant working"


def test_bad_json_bodies_are_400(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url + "/admin/v1", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        err = assert_error(c.post("/orgs", content=b"{nope", headers={"content-type": "application/json"}), 400)
        assert "JSON" in err["message"]
        err = assert_error(c.post("/orgs", json=["a", "list"]), 400)
        assert "object" in err["message"]


def test_other_bad_admin_input_is_400(gateway: Gateway) -> None:
    t = tenant_with(gateway)
    a = gateway.admin
    cases = [
        (a.post(f"/orgs/{t.org_id}/credits", json={}), "amount"),
        (a.post(f"/orgs/{t.org_id}/credits", json={"amount": "ten"}), "amount"),
        (a.patch(f"/orgs/{t.org_id}", json={"monthly_budjet": "5"}), "monthly_budjet"),
        (a.patch(f"/orgs/{t.org_id}", json={"rpm_limit": 1.5}), "rpm_limit"),
        (a.post("/projects", json={"org_id": t.org_id}), "name"),
        (a.post("/keys", json={}), "project_id"),
        (a.post("/keys", json={"project_id": t.project_id, "spend_limit": "x"}), "spend_limit"),
        (a.post("/keys", json={"project_id": t.project_id, "expires_at": "next tuesday"}), "expires_at"),
        (a.patch(f"/keys/{t.key_id}", json={"spend_limt": "1"}), "spend_limt"),
        (a.patch(f"/keys/{t.key_id}", json={"expires_at": [1]}), "expires_at"),
        (a.put("/maintenance", json={"until": time.time() - 10}), "until"),
        (a.put("/maintenance", json={"until": "soon"}), "until"),
    ]
    for r, word in cases:
        err = assert_error(r, 400, type_="invalid_request_error")
        assert word in err["message"], (word, err)
    # Nothing was changed by the rejected requests.
    assert Decimal(t.org()["credits"]) == 10
    assert len(gateway.admin.get("/keys", params={"project_id": t.project_id}).json()["data"]) == 1
    assert gateway.admin.get("/maintenance").json()["active"] is False


def test_unknown_ids_are_404(gateway: Gateway) -> None:
    a = gateway.admin
    for r in (
        a.get("/orgs/org_doesnotexist"),
        a.patch("/orgs/org_doesnotexist", json={"rpm_limit": 5}),
        a.post("/orgs/org_doesnotexist/credits", json={"amount": "1"}),
        a.post("/projects", json={"org_id": "org_doesnotexist", "name": "p"}),
        a.post("/keys", json={"project_id": "proj_doesnotexist"}),
        a.patch("/keys/key_doesnotexist", json={"name": "x"}),
        a.post("/keys/key_doesnotexist/suspend"),
        a.post("/keys/key_doesnotexist/reactivate"),
        a.post("/keys/key_doesnotexist/revoke"),
    ):
        err = assert_error(r, 404)
        assert "doesnotexist" in err["message"], err


def test_unknown_admin_path_is_404_json(gateway: Gateway) -> None:
    r = gateway.admin.get("/widgets")
    assert_error(r, 404)


def test_duplicate_org_name_is_409(gateway: Gateway) -> None:
    name = unique()
    assert gateway.admin.post("/orgs", json={"name": name}).status_code == 201
    err = assert_error(gateway.admin.post("/orgs", json={"name": name, "credits": "5"}), 409)
    assert name in err["message"]
    assert [o["name"] for o in gateway.admin.get("/orgs").json()["data"]].count(name) == 1


# -- credits and limits (core/admission.py) ----------------------------------------------


def test_org_with_no_credits_gets_402_credits_exhausted(gateway: Gateway, sim: Sim) -> None:
    t = tenant_with(gateway, credits="0")
    before = sim.stats()["total"]
    with pytest.raises(openai.APIStatusError) as exc:
        t.openai().chat.completions.create(**CHAT)
    assert exc.value.status_code == 402
    r = chat(t)
    assert_error(r, 402, code="credits_exhausted")
    assert "x-neocloud-generation-id" not in r.headers
    assert sim.stats()["total"] == before, "a 402 must not reach the model"
    assert_not_billed(t, 0, Decimal(0))
    # Topping up lets the very next request through.
    gateway.admin.post(f"/orgs/{t.org_id}/credits", json={"amount": "1"})
    assert chat(t).status_code == 200


def test_credits_that_cannot_cover_the_prompt_are_402_before_the_model(gateway: Gateway, sim: Sim) -> None:
    t = tenant_with(gateway, credits="0.000000001")
    before = sim.stats()["total"]
    assert_error(chat(t), 402, code="credits_exhausted")
    assert_error(chat(t, stream=True), 402, code="credits_exhausted")
    assert sim.stats()["total"] == before
    assert_not_billed(t, 0, Decimal("0.000000001"))


def _spend_until_402(t: Tenant, code: str, limit: int = 200) -> int:
    """Send requests until the first 402; returns how many succeeded."""
    for n in range(limit):
        r = chat(t)
        if r.status_code == 402:
            assert_error(r, 402, code=code)
            return n
        assert r.status_code == 200, r.text
    raise AssertionError("never reached the limit")


def test_org_credits_run_out_exactly(gateway: Gateway) -> None:
    t = tenant_with(gateway, credits="0.0001")
    served = _spend_until_402(t, "credits_exhausted")
    assert served >= 1
    org = t.org()
    assert Decimal(org["credits"]) >= 0, "reservations never let spend pass the credits"
    assert Decimal(org["total_spend"]) == Decimal("0.0001") - Decimal(org["credits"])
    assert_not_billed(t, served, Decimal(org["credits"]))


def test_key_over_its_spend_limit_gets_402(gateway: Gateway) -> None:
    t = tenant_with(gateway, key_fields={"spend_limit": "0.0001"})
    served = _spend_until_402(t, "key_spend_limit_reached")
    assert served >= 1
    spend = Decimal(t.http().get("/v1/key").json()["spend"])
    assert 0 < spend <= Decimal("0.0001")
    credits = Decimal(t.org()["credits"])
    assert_error(chat(t), 402, code="key_spend_limit_reached", type_="insufficient_quota")
    assert_not_billed(t, served, credits)
    assert Decimal(t.http().get("/v1/key").json()["spend"]) == spend
    # Another key of the same org is unaffected.
    other = gateway.admin.post("/keys", json={"project_id": t.project_id}).json()
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {other['key']}"}) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    # Raising the limit lets the key through again.
    gateway.admin.patch(f"/keys/{t.key_id}", json={"spend_limit": "1"})
    assert chat(t).status_code == 200


def test_key_with_zero_spend_limit_gets_402_at_once(gateway: Gateway) -> None:
    t = tenant_with(gateway, key_fields={"spend_limit": "0"})
    assert_error(chat(t), 402, code="key_spend_limit_reached")
    assert_not_billed(t, 0, Decimal(10))


def test_org_over_monthly_budget_gets_402(gateway: Gateway) -> None:
    t = tenant_with(gateway, monthly_budget="0.0001")
    served = _spend_until_402(t, "budget_exceeded")
    assert served >= 1
    org = t.org()
    assert 0 < Decimal(org["month_spend"]) <= Decimal("0.0001")
    credits = Decimal(org["credits"])
    assert credits > 0
    err = assert_error(chat(t), 402, code="budget_exceeded")
    assert "budget" in err["message"].lower()
    assert_not_billed(t, served, credits)
    gateway.admin.patch(f"/orgs/{t.org_id}", json={"monthly_budget": "100"})
    assert chat(t).status_code == 200


def _in_flight(gw: Gateway, org_id: str, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gw.admin.get(f"/orgs/{org_id}").json()["in_flight"] >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"never saw {n} requests in flight")


def test_concurrency_limit_gives_429_without_ratelimit_headers(gateway: Gateway) -> None:
    t = tenant_with(gateway, concurrency_limit=2)
    slow = {"sim": {"delay_ms": 1500}}
    results: list[int] = []

    def run() -> None:
        client = t.openai(timeout=30)
        resp = client.chat.completions.with_raw_response.create(**CHAT, extra_body=slow)
        results.append(resp.status_code)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        _in_flight(gateway, t.org_id, 2)
        started = time.monotonic()
        r = chat(t, sim={"delay_ms": 1500})
        assert time.monotonic() - started < 1.0, "the third request must be refused at once, not queued"
        assert_error(r, 429, code="rate_limit_exceeded")
        assert not [h for h in r.headers if h.lower().startswith("x-ratelimit")], dict(r.headers)
        assert "x-neocloud-generation-id" not in r.headers
    finally:
        for th in threads:
            th.join(30)
    assert results == [200, 200]
    assert len(t.usage()) == 2, "the refused request is not billed"
    assert t.org()["in_flight"] == 0
    assert chat(t).status_code == 200  # slots are released


def test_concurrency_limit_counts_streams(gateway: Gateway) -> None:
    t = tenant_with(gateway, concurrency_limit=1)
    with t.http() as c, c.stream("POST", "/v1/chat/completions",
                                 json={**CHAT, "stream": True, "sim": {"delay_ms": 1000}}) as s:
        _in_flight(gateway, t.org_id, 1)
        assert_error(chat(t), 429, code="rate_limit_exceeded")
        body = s.read()
        assert s.status_code == 200 and body.rstrip().endswith(b"data: [DONE]")
    assert chat(t).status_code == 200


def test_rpm_limit_gives_429_with_reset_and_retry_after(gateway: Gateway) -> None:
    t = tenant_with(gateway, rpm_limit=2)
    assert chat(t).status_code == 200
    assert chat(t).status_code == 200
    r = chat(t)
    err = assert_error(r, 429, code="rate_limit_exceeded")
    reset = int(r.headers["x-ratelimit-reset"])
    retry = int(r.headers["retry-after"])
    assert 1 <= reset <= 60 and 1 <= retry <= 60
    assert "x-neocloud-generation-id" not in r.headers
    assert err["message"]
    with pytest.raises(openai.RateLimitError):
        t.openai().chat.completions.create(**CHAT)
    assert len(t.usage()) == 2, "429s are not billed"


# -- maintenance ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def private_gateway(sim: Sim) -> Iterator[Gateway]:
    gw = start_gateway(catalog_toml(sim.url))
    yield gw
    stop(gw.proc)


def test_maintenance_on_and_off(private_gateway: Gateway) -> None:
    gw = private_gateway
    t = gw.new_key()
    assert chat(t).status_code == 200
    until = int(time.time()) + 3600
    r = gw.admin.put("/maintenance", json={"until": until, "message": "Upgrading."})
    assert r.status_code == 200, r.text
    assert r.json()["active"] is True and r.json()["until"] == until
    try:
        for extra in ({}, {"stream": True}):
            r = chat(t, **extra)
            err = assert_error(r, 503)
            assert "Upgrading." in err["message"]
            retry_after = r.headers["retry-after"]
            assert parsedate_to_datetime(retry_after).timestamp() == until
            assert "x-neocloud-generation-id" not in r.headers
        with pytest.raises(openai.InternalServerError) as exc:
            t.openai().chat.completions.create(**CHAT)
        assert exc.value.status_code == 503
        health = httpx.get(gw.url + "/health").json()
        assert health["status"] == "maintenance"
        assert health["maintenance_until"] == until
        assert gw.admin.get("/maintenance").json()["active"] is True
        assert len(t.usage()) == 1, "503s are not billed"
    finally:
        off = gw.admin.put("/maintenance", json={"until": None})
    assert off.status_code == 200 and off.json()["active"] is False
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"
    assert chat(t).status_code == 200
    assert len(t.usage()) == 2


def test_maintenance_with_iso_date_and_auth_first(private_gateway: Gateway) -> None:
    gw = private_gateway
    r = gw.admin.put("/maintenance", json={"until": "2099-12-01T06:00:00Z"})
    assert r.status_code == 200, r.text
    try:
        # An unauthenticated request is still a 401, not a 503.
        with httpx.Client(base_url=gw.url) as c:
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 401
        r = chat(gw.new_key())
        assert_error(r, 503)
        assert r.headers["retry-after"] == "Tue, 01 Dec 2099 06:00:00 GMT"
    finally:
        gw.admin.put("/maintenance", json={"until": None})
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"

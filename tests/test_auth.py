"""Authentication, per api-reference "Authentication" and the gateway errors table.

Every test talks HTTP to the session gateway (the real `kiln serve`) in front
of the real simulator. The OpenAI SDK is used where a user would use it; httpx
where the test needs exact headers or bytes.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from decimal import Decimal
from typing import Any

import httpx
import openai
import pytest

from conftest import Gateway, Sim, Tenant, assert_recorded_at_no_cost

CHAT = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 20}


# -- helpers ---------------------------------------------------------------------


def post_chat(gw: Gateway, headers: dict[str, str], path: str = "/v1/chat/completions",
              body: dict[str, Any] | None = None) -> httpx.Response:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        return c.post(path, json=body or CHAT, headers=headers)


def get_models(gw: Gateway, headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        return c.get("/v1/models", headers=headers)


def assert_openai_error(r: httpx.Response, status: int, type_: str, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["type"] == type_, err
    if code is not None:
        assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"].strip(), err
    assert "x-neocloud-generation-id" not in r.headers
    return err


def assert_401(r: httpx.Response) -> dict[str, Any]:
    return assert_openai_error(r, 401, "authentication_error", "invalid_api_key")


def db_rows(gw: Gateway, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{gw.data_dir / 'kiln.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def not_billed(t: Tenant, credits_before: str) -> None:
    assert t.usage() == []
    org = t.org()
    assert Decimal(org["credits"]) == Decimal(credits_before)
    assert org["usage_events"] == 0
    assert Decimal(org["total_spend"]) == 0


def create_key(gw: Gateway, project_id: str, **fields: Any) -> dict[str, Any]:
    r = gw.admin.post("/keys", json={"project_id": project_id, "name": "extra", **fields})
    assert r.status_code == 201, r.text
    return r.json()


# -- the credential headers --------------------------------------------------------


def test_bearer_works_with_the_openai_sdk(tenant: Tenant) -> None:
    client = tenant.openai()
    resp = client.chat.completions.create(**CHAT)
    assert resp.choices[0].message.content
    ids = {m.id for m in client.models.list().data}
    assert "qwen3-32b" in ids


def test_x_api_key_works_when_authorization_is_absent(tenant: Tenant) -> None:
    r = post_chat(tenant.gw, {"x-api-key": tenant.key})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cost"] > 0
    assert r.headers["x-neocloud-generation-id"].startswith("gen-")
    m = get_models(tenant.gw, {"x-api-key": tenant.key})
    assert m.status_code == 200, m.text
    assert m.json()["object"] == "list"


def test_authorization_wins_over_a_bad_x_api_key(tenant: Tenant) -> None:
    r = post_chat(tenant.gw, {"Authorization": f"Bearer {tenant.key}", "x-api-key": "sk-kiln-not-a-real-key"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("endpoint", ["chat", "models"])
def test_bad_bearer_with_valid_x_api_key_is_401(tenant: Tenant, endpoint: str) -> None:
    headers = {"Authorization": "Bearer sk-kiln-wrong-" + "a" * 30, "x-api-key": tenant.key}
    r = post_chat(tenant.gw, headers) if endpoint == "chat" else get_models(tenant.gw, headers)
    assert_401(r)


@pytest.mark.parametrize("endpoint", ["chat", "models"])
@pytest.mark.parametrize("authorization", ["Basic dXNlcjpwYXNz", "Token {key}", "{key}", "Bearer", "Basic {key}"])
def test_non_bearer_authorization_does_not_fall_back_to_x_api_key(
    tenant: Tenant, endpoint: str, authorization: str
) -> None:
    headers = {"Authorization": authorization.format(key=tenant.key), "x-api-key": tenant.key}
    r = post_chat(tenant.gw, headers) if endpoint == "chat" else get_models(tenant.gw, headers)
    assert_401(r)


@pytest.mark.parametrize("endpoint", ["chat", "models"])
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"x-api-key": ""},
        {"Authorization": ""},
        {"Authorization": "Bearer sk-kiln-unknown-" + "b" * 30},
        {"x-api-key": "sk-kiln-unknown-" + "c" * 30},
        {"Authorization": "Bearer not-even-a-kiln-key"},
    ],
    ids=["missing", "empty-x-api-key", "empty-authorization", "unknown-bearer", "unknown-x-api-key", "malformed"],
)
def test_missing_malformed_or_unknown_key_is_401(gateway: Gateway, endpoint: str, headers: dict[str, str]) -> None:
    r = post_chat(gateway, headers) if endpoint == "chat" else get_models(gateway, headers)
    assert_401(r)


def test_openai_sdk_raises_authentication_error_for_unknown_key(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-kiln-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.chat.completions.create(**CHAT)
    assert exc.value.status_code == 401
    assert exc.value.code == "invalid_api_key"


def test_a_revealed_admin_credential_is_not_an_api_key(gateway: Gateway) -> None:
    from conftest import ADMIN_KEY

    assert_401(post_chat(gateway, {"Authorization": f"Bearer {ADMIN_KEY}"}))


def test_unauthenticated_requests_never_reach_the_backend(gateway: Gateway, sim: Sim) -> None:
    before = sim.stats()["total"]
    for headers in ({}, {"Authorization": "Basic eA=="}, {"Authorization": "Bearer sk-kiln-unknown"}):
        assert_401(post_chat(gateway, headers))
    assert sim.stats()["total"] == before


def test_auth_is_checked_before_the_body_is_read(gateway: Gateway) -> None:
    """'A request with no usable key is rejected with 401 before it reaches the endpoint.'"""
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_401(r)


# -- expiry ------------------------------------------------------------------------------


def test_key_created_already_expired_is_401(tenant: Tenant) -> None:
    k = create_key(tenant.gw, tenant.project_id, expires_at=time.time() - 60)
    assert k["key"].startswith("sk-kiln-")
    err = assert_401(post_chat(tenant.gw, {"Authorization": f"Bearer {k['key']}"}))
    assert "expire" in err["message"].lower()
    assert_401(get_models(tenant.gw, {"x-api-key": k["key"]}))
    with httpx.Client(base_url=tenant.gw.url, timeout=30) as c:
        assert_401(c.get("/v1/key", headers={"Authorization": f"Bearer {k['key']}"}))


def test_key_expiring_in_a_second_works_then_is_401(tenant: Tenant) -> None:
    expires = time.time() + 1.5
    k = create_key(tenant.gw, tenant.project_id, expires_at=expires)
    headers = {"Authorization": f"Bearer {k['key']}"}
    r = post_chat(tenant.gw, headers)
    assert r.status_code == 200, r.text
    time.sleep(max(0.0, expires - time.time()) + 0.2)
    assert_401(post_chat(tenant.gw, headers))
    assert_401(get_models(tenant.gw, headers))


def test_expiry_given_as_iso_date_in_the_past_is_401(tenant: Tenant) -> None:
    k = create_key(tenant.gw, tenant.project_id, expires_at="2020-01-01T00:00:00Z")
    assert k["expires_at"] == 1577836800
    assert_401(post_chat(tenant.gw, {"Authorization": f"Bearer {k['key']}"}))


def test_setting_expiry_in_the_past_takes_effect_on_next_request(tenant: Tenant) -> None:
    headers = {"Authorization": f"Bearer {tenant.key}"}
    assert post_chat(tenant.gw, headers).status_code == 200
    r = tenant.gw.admin.patch(f"/keys/{tenant.key_id}", json={"expires_at": time.time() - 1})
    assert r.status_code == 200, r.text
    assert_401(post_chat(tenant.gw, headers))
    r = tenant.gw.admin.patch(f"/keys/{tenant.key_id}", json={"expires_at": None})
    assert r.status_code == 200, r.text
    assert post_chat(tenant.gw, headers).status_code == 200


# -- suspend / reactivate / revoke -----------------------------------------------------


def test_suspended_key_is_403_and_reactivated_key_works_on_the_very_next_request(tenant: Tenant) -> None:
    client = tenant.openai()
    client.chat.completions.create(**CHAT)
    r = tenant.gw.admin.post(f"/keys/{tenant.key_id}/suspend")
    assert r.status_code == 200 and r.json()["status"] == "suspended", r.text
    with pytest.raises(openai.PermissionDeniedError) as exc:
        client.chat.completions.create(**CHAT)
    assert exc.value.status_code == 403
    raw = post_chat(tenant.gw, {"Authorization": f"Bearer {tenant.key}"})
    assert_openai_error(raw, 403, "permission_error")
    assert_openai_error(get_models(tenant.gw, {"x-api-key": tenant.key}), 403, "permission_error")
    r = tenant.gw.admin.post(f"/keys/{tenant.key_id}/reactivate")
    assert r.status_code == 200 and r.json()["status"] == "active", r.text
    resp = client.chat.completions.create(**CHAT)  # the very next request
    assert resp.choices[0].message.content


def test_revoked_key_is_403_and_cannot_be_reactivated(tenant: Tenant) -> None:
    r = tenant.gw.admin.post(f"/keys/{tenant.key_id}/revoke")
    assert r.status_code == 200 and r.json()["status"] == "revoked", r.text
    assert_openai_error(post_chat(tenant.gw, {"Authorization": f"Bearer {tenant.key}"}), 403, "permission_error")
    r = tenant.gw.admin.post(f"/keys/{tenant.key_id}/reactivate")
    assert r.status_code == 409, r.text
    assert r.json()["error"]["message"]
    r = tenant.gw.admin.post(f"/keys/{tenant.key_id}/suspend")
    assert r.status_code == 409, r.text
    keys = tenant.gw.admin.get("/keys", params={"project_id": tenant.project_id}).json()["data"]
    assert [k["status"] for k in keys if k["id"] == tenant.key_id] == ["revoked"]
    assert_openai_error(post_chat(tenant.gw, {"x-api-key": tenant.key}), 403, "permission_error")


def test_suspending_one_key_leaves_the_others_of_the_project_working(tenant: Tenant) -> None:
    other = create_key(tenant.gw, tenant.project_id)
    assert tenant.gw.admin.post(f"/keys/{tenant.key_id}/suspend").status_code == 200
    assert post_chat(tenant.gw, {"Authorization": f"Bearer {tenant.key}"}).status_code == 403
    assert post_chat(tenant.gw, {"Authorization": f"Bearer {other['key']}"}).status_code == 200


# -- headers that change nothing -----------------------------------------------------


def test_anthropic_headers_and_beta_query_change_nothing(tenant: Tenant) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "Same answer either way, please."}]}
    plain = post_chat(tenant.gw, {"Authorization": f"Bearer {tenant.key}"}, body=body)
    extra = post_chat(
        tenant.gw,
        {"Authorization": f"Bearer {tenant.key}", "anthropic-version": "2023-06-01",
         "anthropic-beta": "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14"},
        path="/v1/chat/completions?beta=true",
        body=body,
    )
    assert plain.status_code == extra.status_code == 200, (plain.text, extra.text)
    a, b = plain.json(), extra.json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]
    assert a["usage"]["cost"] > 0 and b["usage"]["cost"] > 0
    assert b["object"] == "chat.completion"
    m = get_models(tenant.gw, {"Authorization": f"Bearer {tenant.key}", "anthropic-version": "2023-06-01"})
    assert m.status_code == 200
    events = tenant.usage()
    assert len(events) == 2
    assert {e["id"] for e in events} == {plain.headers["x-neocloud-generation-id"],
                                          extra.headers["x-neocloud-generation-id"]}


def test_anthropic_headers_do_not_rescue_a_bad_key(tenant: Tenant) -> None:
    headers = {"Authorization": "Bearer sk-kiln-bad", "x-api-key": tenant.key,
               "anthropic-version": "2023-06-01", "anthropic-beta": "x"}
    assert_401(post_chat(tenant.gw, headers, path="/v1/chat/completions?beta=true"))


# -- rejected requests are not billed -------------------------------------------------


def test_rejected_requests_are_not_billed(gateway: Gateway) -> None:
    t = gateway.new_key(credits="3")
    # 401: a wrong Bearer with the tenant's x-api-key, and a Basic header.
    assert_401(post_chat(gateway, {"Authorization": "Bearer sk-kiln-x", "x-api-key": t.key}))
    assert_401(post_chat(gateway, {"Authorization": "Basic Zm9vOmJhcg==", "x-api-key": t.key}))
    # 403: suspended.
    gateway.admin.post(f"/keys/{t.key_id}/suspend")
    assert post_chat(gateway, {"Authorization": f"Bearer {t.key}"}).status_code == 403
    not_billed(t, "3")
    key = gateway.admin.get("/keys", params={"project_id": t.project_id}).json()["data"][0]
    assert Decimal(key["spend"]) == 0


def test_expired_and_revoked_requests_are_not_billed(gateway: Gateway) -> None:
    t = gateway.new_key(credits="2")
    expired = create_key(gateway, t.project_id, expires_at=time.time() - 5)
    assert_401(post_chat(gateway, {"Authorization": f"Bearer {expired['key']}"}))
    gateway.admin.post(f"/keys/{t.key_id}/revoke")
    assert post_chat(gateway, {"Authorization": f"Bearer {t.key}"}).status_code == 403
    not_billed(t, "2")
    assert gateway.admin.get("/usage", params={"key_id": expired["id"]}).json()["data"] == []


# -- keys: shown once, stored hashed --------------------------------------------------


def test_key_is_shown_once_and_listings_show_only_a_prefix(tenant: Tenant) -> None:
    k = create_key(tenant.gw, tenant.project_id, spend_limit="1")
    secret = k["key"]
    assert secret.startswith("sk-kiln-")
    assert len(secret) >= len("sk-kiln-") + 32
    assert secret != tenant.key
    assert secret.startswith(k["prefix"].rstrip("…").rstrip("."))
    assert len(k["prefix"].rstrip("…")) < len(secret)
    listing = tenant.gw.admin.get("/keys", params={"project_id": tenant.project_id})
    assert listing.status_code == 200
    assert secret not in listing.text and tenant.key not in listing.text
    for row in listing.json()["data"]:
        assert "key" not in row
        assert "key_hash" not in row
    by_id = {row["id"]: row for row in listing.json()["data"]}
    assert by_id[k["id"]]["prefix"] == k["prefix"]
    all_keys = tenant.gw.admin.get("/keys")
    assert secret not in all_keys.text
    # The key works.
    assert post_chat(tenant.gw, {"Authorization": f"Bearer {secret}"}).status_code == 200


def test_key_is_stored_as_sha256_hex_not_in_clear(tenant: Tenant) -> None:
    rows = db_rows(tenant.gw, "SELECT key_hash, prefix FROM api_keys WHERE id = ?", (tenant.key_id,))
    assert len(rows) == 1
    key_hash, prefix = rows[0]
    assert key_hash == hashlib.sha256(tenant.key.encode()).hexdigest()
    assert len(key_hash) == 64 and all(ch in "0123456789abcdef" for ch in key_hash)
    assert tenant.key not in prefix
    # The secret appears nowhere in the database files (main file and WAL).
    needle = tenant.key.encode()
    for suffix in ("", "-wal"):
        path = tenant.gw.data_dir / f"kiln.db{suffix}"
        if path.exists():
            assert needle not in path.read_bytes(), f"the clear key is stored in {path.name}"


def test_every_key_starts_with_sk_kiln(gateway: Gateway) -> None:
    keys = [gateway.new_key().key for _ in range(3)]
    assert all(k.startswith("sk-kiln-") for k in keys)
    assert len(set(keys)) == 3


# -- GET /v1/key -------------------------------------------------------------------------


def test_key_info_is_bearer_only(tenant: Tenant) -> None:
    with httpx.Client(base_url=tenant.gw.url, timeout=30) as c:
        assert_401(c.get("/v1/key", headers={"x-api-key": tenant.key}))
        assert_401(c.get("/v1/key"))
        assert_401(c.get("/v1/key", headers={"Authorization": "Bearer sk-kiln-unknown"}))
        assert_401(c.get("/v1/key", headers={"Authorization": f"Basic {tenant.key}", "x-api-key": tenant.key}))
        ok = c.get("/v1/key", headers={"Authorization": f"Bearer {tenant.key}"})
    assert ok.status_code == 200, ok.text


def test_key_info_returns_project_status_limit_expiry_and_spend(tenant: Tenant) -> None:
    expires = int(time.time()) + 3600
    k = create_key(tenant.gw, tenant.project_id, spend_limit="2.5", expires_at=expires)
    with httpx.Client(base_url=tenant.gw.url, timeout=30) as c:
        r = c.get("/v1/key", headers={"Authorization": f"Bearer {k['key']}"})
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["project"]["id"] == tenant.project_id
    assert info["project"]["name"] == "p"
    assert info["status"] == "active"
    assert Decimal(info["spend_limit"]) == Decimal("2.5")
    assert info["expires_at"] == expires
    assert Decimal(info["spend"]) == 0
    assert k["key"] not in r.text
    # A key without limits reports them as null.
    with httpx.Client(base_url=tenant.gw.url, timeout=30) as c:
        plain = c.get("/v1/key", headers={"Authorization": f"Bearer {tenant.key}"}).json()
    assert plain["spend_limit"] is None and plain["expires_at"] is None


def test_key_info_spend_grows_by_exactly_the_event_cost(tenant: Tenant) -> None:
    http = tenant.http()
    before = Decimal(http.get("/v1/key").json()["spend"])
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    gen_id = r.headers["x-neocloud-generation-id"]
    [event] = [e for e in tenant.usage() if e["id"] == gen_id]
    after = Decimal(http.get("/v1/key").json()["spend"])
    assert after - before == Decimal(event["cost"]) > 0
    r2 = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r2.status_code == 200
    gen2 = r2.headers["x-neocloud-generation-id"]
    [event2] = [e for e in tenant.usage() if e["id"] == gen2]
    final = Decimal(http.get("/v1/key").json()["spend"])
    assert final - after == Decimal(event2["cost"]) > 0
    # GET /v1/key itself is not metered.
    assert len(tenant.usage()) == 2


def test_key_info_of_a_suspended_key_does_not_claim_it_is_active(tenant: Tenant) -> None:
    tenant.gw.admin.post(f"/keys/{tenant.key_id}/suspend")
    r = tenant.http().get("/v1/key")
    if r.status_code == 200:
        assert r.json()["status"] == "suspended"
    else:
        assert_openai_error(r, 403, "permission_error")


# -- GET /v1/models ------------------------------------------------------------------------


def test_models_list_has_the_openai_shape_and_only_available_models(tenant: Tenant) -> None:
    r = tenant.http().get("/v1/models")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    ids = [m["id"] for m in body["data"]]
    assert len(ids) == len(set(ids))
    for m in body["data"]:
        assert m["object"] == "model"
        assert isinstance(m["created"], int)
        assert isinstance(m["owned_by"], str) and m["owned_by"]
    assert {"qwen3-32b", "gpt-oss-120b"} <= set(ids)
    assert "offline-model" not in ids, "a model whose only backend is down must not be listed"
    # The SDK parses it.
    sdk_ids = {m.id for m in tenant.openai().models.list()}
    assert sdk_ids == set(ids)


def test_models_list_includes_aliases(tenant: Tenant) -> None:
    data = {m["id"]: m for m in tenant.http().get("/v1/models").json()["data"]}
    assert "claude-opus-5-5" in data and "gpt-5" in data
    assert data["claude-opus-5-5"]["object"] == "model"
    assert data["claude-opus-5-5"].get("alias_of") == "qwen3-32b"
    assert data["gpt-5"].get("alias_of") == "gpt-oss-120b"
    # An alias is servable under its listed name.
    resp = tenant.openai().chat.completions.create(**{**CHAT, "model": "claude-opus-5-5"})
    assert resp.choices[0].message.content


def test_models_are_not_labelled_simulated_when_configured(tenant: Tenant) -> None:
    data = {m["id"]: m for m in tenant.http().get("/v1/models").json()["data"]}
    for mid in ("qwen3-32b", "gpt-oss-120b"):
        assert data[mid].get("simulated", False) is False
        assert "simulated" not in data[mid]["owned_by"]


def test_models_list_is_not_billed_and_has_no_generation_id(tenant: Tenant, sim: Sim) -> None:
    before = sim.stats()["total"]
    for _ in range(3):
        r = tenant.http().get("/v1/models")
        assert r.status_code == 200
        assert "x-neocloud-generation-id" not in r.headers
    assert sim.stats()["total"] == before
    not_billed(tenant, "10")


def test_offline_model_is_unavailable_not_billed(tenant: Tenant) -> None:
    health = tenant.gw.admin.get(tenant.gw.url + "/health").json()  # details need the admin credential
    assert health["models"]["offline-model"] is False
    assert health["models"]["qwen3-32b"] is True
    r = post_chat(tenant.gw, {"Authorization": f"Bearer {tenant.key}"}, body={**CHAT, "model": "offline-model"})
    assert r.status_code in (502, 503), r.text
    assert_recorded_at_no_cost(tenant, r)


def test_models_follow_backend_health(sim: Sim) -> None:
    """A model leaves GET /v1/models when its backend dies and returns when it is back (probe every 1 s)."""
    from conftest import catalog_toml, free_port, start_gateway, start_sim, stop

    port = free_port()
    extra_sim = start_sim("--model", "flaky-upstream", "--port", str(port))
    extra = f"""
[[models]]
id = "flaky"
context_window = 4096
prices = {{ input = "1", output = "2" }}
[[models.backends]]
url = "http://127.0.0.1:{port}/v1"
model = "flaky-upstream"
"""
    gw = start_gateway(catalog_toml(sim.url, extra))
    try:
        t = gw.new_key()

        def listed() -> set[str]:
            return {m["id"] for m in t.http().get("/v1/models").json()["data"]}

        def wait_for(cond: Any, timeout: float = 8.0) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if cond():
                    return True
                time.sleep(0.1)
            return False

        assert "flaky" in listed()
        stop(extra_sim.proc)
        assert wait_for(lambda: "flaky" not in listed()), "a dead backend's model is still listed"
        assert "qwen3-32b" in listed()
        extra_sim = start_sim("--model", "flaky-upstream", "--port", str(port))
        assert wait_for(lambda: "flaky" in listed()), "the model did not come back with its backend"
        assert t.openai().chat.completions.create(**{**CHAT, "model": "flaky"}).usage.total_tokens > 0
    finally:
        stop(gw.proc)
        stop(extra_sim.proc)

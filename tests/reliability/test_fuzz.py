"""Property-based fuzzing of every endpoint with Hypothesis, against one running gateway.

Bodies: a valid body per endpoint, mutated at any JSON path (any other JSON value in any
field, a field removed, extra fields, nesting up to ~2,000 deep, huge numbers, unicode
and NUL in names), then serialised, sometimes with invalid UTF-8 spliced in; and raw
bytes. Headers: authorisation forms, content types, content-length lies (raw sockets).
Query strings on every GET. The property: no answer is 5xx, and every 4xx is JSON in the
caller's protocol (Anthropic's under /v1/messages, OpenAI's elsewhere).

Deterministic (derandomised) with a bounded number of examples; --soak multiplies them.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ADMIN_KEY, Gateway, Sim, Tenant, catalog_toml, start_gateway, stop
from reliability.conftest import soak_enabled
from reliability.harness import observe

DEEP = "__kiln_deep__"
STATUSES: dict[str, Counter[int]] = {}  # path -> status -> answers
FINDINGS: list[dict[str, Any]] = []  # 5xx, or 4xx not in the caller's protocol
_THIS_TEST = {"tried": 0, "first_finding": 0}


@pytest.fixture(autouse=True)
def _per_test() -> None:
    _THIS_TEST.update(tried=0, first_finding=len(FINDINGS))

# -- endpoints and valid bodies ---------------------------------------------------------------

TOOLS_CHAT = [{"type": "function", "function": {"name": "f", "description": "d",
                                                 "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}]
METERED: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": "qwen3-32b", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
        "max_tokens": 8, "stream": False, "temperature": 0.5, "top_p": 1, "stop": ["zz"], "n": 1,
        "tools": TOOLS_CHAT, "tool_choice": "auto", "user": "u", "seed": 1, "logprobs": False,
    },
    "/v1/completions": {"model": "qwen3-32b", "prompt": "hi", "max_tokens": 8, "n": 1, "echo": False,
                        "stop": "zz", "stream": False, "logprobs": None, "suffix": None},
    "/v1/responses": {
        "model": "gpt-oss-120b", "instructions": "be brief", "max_output_tokens": 8, "stream": False,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "reasoning": {"effort": "low"},
    },
    "/v1/messages": {
        "model": "claude-sonnet-4-5", "max_tokens": 8, "system": [{"type": "text", "text": "s"}], "stream": False,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "stop_sequences": ["zz"],
        "metadata": {"user_id": "u"}, "temperature": 0.2,
    },
    "/v1/messages/count_tokens": {
        "model": "claude-sonnet-4-5", "system": "s", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    },
}
ADMIN = {  # path template -> (method, valid body)
    "/admin/v1/orgs": ("POST", {"name": "fuzz", "credits": "1", "monthly_budget": "1", "rpm_limit": 10,
                                "tpm_limit": 10, "concurrency_limit": 2}),
    "/admin/v1/orgs/{org}": ("PATCH", {"monthly_budget": "5", "rpm_limit": 100000, "concurrency_limit": 64}),
    "/admin/v1/orgs/{org}/credits": ("POST", {"amount": "0.000001", "note": "fuzz"}),
    "/admin/v1/projects": ("POST", {"org_id": "{org}", "name": "p"}),
    "/admin/v1/keys": ("POST", {"project_id": "{project}", "name": "k", "spend_limit": "1", "expires_at": None,
                                "spend_reset": "daily", "rpm_limit": 5}),
    "/admin/v1/keys/{spare_key}": ("PATCH", {"name": "k2", "spend_limit": "2", "spend_reset": "never"}),
}
GETS = ["/v1/models", "/v1/key", "/health", "/admin/v1/usage", "/admin/v1/keys", "/admin/v1/projects",
        "/admin/v1/orgs", "/admin/v1/orgs/{org}", "/admin/v1/maintenance"]


def examples(config: Any, default: int) -> int:
    return default * 20 if soak_enabled(config) else default


# -- strategies -------------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["", "\u0000", "model\u0000", "é", "🦙", "\u202e", "a" * 300, "../etc", "null", "qwen3-32b\n"])
numbers = st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(
    [0, -1, 2**63, 2**64, 10**30, 1e308, -1e308, 0.5, 1e-320]) | st.floats(allow_nan=False, allow_infinity=False)
scalars = st.none() | st.booleans() | numbers | names
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(names, inner, max_size=4), max_leaves=12)
deep = st.tuples(st.integers(min_value=100, max_value=2000), st.sampled_from(["[", "{"]))


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from paths(v, prefix + (i,))


def replaced(value: Any, path: tuple[Any, ...], new: Any, delete: bool = False) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        out = dict(value)
        if delete and not rest:
            out.pop(head, None)
        else:
            out[head] = replaced(value[head], rest, new, delete)
        return out
    out_list = list(value)
    if delete and not rest:
        out_list.pop(head)
    else:
        out_list[head] = replaced(value[head], rest, new, delete)
    return out_list


def _deep_text(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "[" else ('{"a":' * depth + "1" + "}" * depth)


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> bytes:
    """A valid body with up to three mutations, serialised; sometimes not UTF-8."""
    body = base
    deep_parts = []
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        where = draw(st.sampled_from(list(paths(body))))
        action = draw(st.sampled_from(["replace", "replace", "delete", "deep", "extra"]))
        if action == "delete" and where:
            body = replaced(body, where, None, delete=True)
        elif action == "deep":
            deep_parts.append(_deep_text(*draw(deep)))
            body = replaced(body, where, DEEP)
        elif action == "extra" and isinstance(body, dict):
            body = {**body, draw(names): draw(json_values)}
        else:
            body = replaced(body, where, draw(json_values))
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))
    for part in deep_parts:
        text = text.replace(json.dumps(DEEP), part, 1)
    raw = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(min_value=0, max_value=9)) == 0:  # invalid UTF-8 spliced in
        at = draw(st.integers(min_value=0, max_value=len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + raw[at:]
    return raw


# -- the property -------------------------------------------------------------------------------


def check(path: str, status: int, ctype: str, body: bytes, sent: Any = None) -> None:
    """Record the answer; a 5xx or a 4xx not in the caller's protocol is a finding."""
    STATUSES.setdefault(path, Counter())[status] += 1
    _THIS_TEST["tried"] += 1
    problem = _problem(path, status, ctype, body)
    if problem:
        FINDINGS.append({"path": path, "status": status, "problem": problem, "answer": body[:200],
                         "sent": repr(sent)[:300]})


def _problem(path: str, status: int, ctype: str, body: bytes) -> str:
    if status >= 500:
        return "5xx"
    if status < 400:
        return ""
    if not ctype.startswith("application/json"):
        return f"4xx not JSON ({ctype})"
    try:
        data = json.loads(body)
        if path.startswith("/v1/messages"):
            ok = data.get("type") == "error" and isinstance(data["error"]["message"], str)
        else:
            ok = isinstance(data["error"]["message"], str)
    except (ValueError, KeyError, TypeError):
        ok = False
    return "" if ok else "4xx not in the caller's protocol"


def assert_no_findings(path: str) -> None:
    mine = FINDINGS[_THIS_TEST["first_finding"]:]
    kinds = Counter(f"{f['status']} {f['problem']}" for f in mine)
    assert not mine, (f"{len(mine)} of {_THIS_TEST['tried']} inputs on {path} got a wrong answer "
                      f"({dict(kinds)}); first: {mine[:3]}")


class Target:
    def __init__(self, gw: Gateway, tenant: Tenant, spare_key: str) -> None:
        self.gw, self.tenant = gw, tenant
        self.ids = {"{org}": tenant.org_id, "{project}": tenant.project_id, "{spare_key}": spare_key}
        self.client = httpx.Client(base_url=gw.url, timeout=60)

    def fill(self, text: str) -> str:
        for k, v in self.ids.items():
            text = text.replace(k, v)
        return text

    def call(self, method: str, path: str, content: bytes | None = None, headers: dict[str, Any] | None = None,
             admin: bool = False) -> None:
        auth = {"Authorization": f"Bearer {ADMIN_KEY if admin else self.tenant.key}"}
        r = self.client.request(method, path, content=content,
                                headers={**auth, "Content-Type": "application/json", **(headers or {})})
        check(path.split("?")[0], r.status_code, r.headers.get("content-type", ""), r.content, content)


@pytest.fixture(scope="module")
def target(sim: Sim) -> Iterator[Target]:
    gw = start_gateway(catalog_toml(sim.url))
    tenant = gw.new_key(credits="50")
    spare = gw.admin.post("/keys", json={"project_id": tenant.project_id, "name": "spare"}).json()["id"]
    t = Target(gw, tenant, spare)
    yield t
    counts = {p: dict(c) for p, c in STATUSES.items()}
    observe("fuzz", inputs=sum(sum(c.values()) for c in STATUSES.values()), statuses_by_endpoint=counts,
            findings=len(FINDINGS), findings_by_kind=dict(Counter(f"{f['path']} {f['status']} {f['problem']}"
                                                                 for f in FINDINGS)),
            examples=FINDINGS[:20])
    t.client.close()
    stop(gw.proc)


def _fuzz(fn: Any, n: int) -> Any:
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))(fn)


@pytest.mark.parametrize("path", list(METERED))
def test_metered_bodies(target: Target, path: str, pytestconfig: pytest.Config) -> None:
    @given(raw=mutated(METERED[path]) | st.binary(max_size=64))
    def run(raw: bytes) -> None:
        target.call("POST", path, raw)

    _fuzz(run, examples(pytestconfig, 200))()
    assert_no_findings(path)


@pytest.mark.parametrize("template", list(ADMIN))
def test_admin_bodies(target: Target, template: str, pytestconfig: pytest.Config) -> None:
    method, base = ADMIN[template]
    base = json.loads(target.fill(json.dumps(base)))

    @given(raw=mutated(base) | st.binary(max_size=64))
    def run(raw: bytes) -> None:
        target.call(method, target.fill(template), raw, admin=True)

    _fuzz(run, examples(pytestconfig, 60))()
    assert_no_findings(target.fill(template))


AUTH_FORMS = st.sampled_from(["", "Bearer", "Bearer ", "bearer {key}", "Bearer  {key}", "Bearer {key} {key}",
                              "Basic {key}", "Bearer sk-kiln-" + "x" * 5000, "Bearer {key}\t", "Token {key}",
                              "Bearer é", "Bearer {admin}"]) | st.text(st.characters(codec="latin-1",
                                                                                      blacklist_characters="\r\n\x00"),
                                                                         max_size=40)
CONTENT_TYPES = st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1",
                                 "multipart/form-data; boundary=x", "application/x-www-form-urlencoded",
                                 "application/json\u00e9"])


@pytest.mark.parametrize("path", list(METERED) + ["/v1/models", "/v1/key"])
def test_headers(target: Target, path: str, pytestconfig: pytest.Config) -> None:
    @given(auth=AUTH_FORMS, x_api_key=st.none() | AUTH_FORMS, ctype=CONTENT_TYPES, gzip=st.booleans())
    def run(auth: str, x_api_key: str | None, ctype: str, gzip: bool) -> None:
        key = target.tenant.key
        headers: dict[str, Any] = {"Authorization": auth.format(key=key, admin=ADMIN_KEY).encode("latin-1"),
                                   "Content-Type": ctype.encode("utf-8")}
        if x_api_key is not None:
            headers["x-api-key"] = x_api_key.format(key=key, admin=ADMIN_KEY).encode("latin-1")
        if gzip:
            headers["Content-Encoding"] = "gzip"
        method = "POST" if path in METERED else "GET"
        body = json.dumps(METERED.get(path, {})).encode()
        try:
            r = target.client.request(method, path, content=body, headers=headers)
        except httpx.LocalProtocolError:
            return  # not a header an HTTP client can send
        check(path, r.status_code, r.headers.get("content-type", ""), r.content, headers)

    _fuzz(run, examples(pytestconfig, 40))()
    assert_no_findings(path)


@pytest.mark.parametrize("path", GETS)
def test_query_strings(target: Target, path: str, pytestconfig: pytest.Config) -> None:
    keys = st.sampled_from(["limit", "org_id", "key_id", "project_id", "x", "limit[]", ""]) | names
    values = st.sampled_from(["-1", "0", "99999999999999999999", "1e3", "%ff", "%00", "", "a" * 5000]) | names

    @given(pairs=st.lists(st.tuples(keys, values), max_size=4), raw=st.booleans())
    def run(pairs: list[tuple[str, str]], raw: bool) -> None:
        if raw:  # unescaped, as a hostile client would send it
            query = "&".join(f"{k}={v}" for k, v in pairs).replace("#", "%23").replace(" ", "%20")
            url = target.fill(path) + ("?" + query if query else "")
            params = None
        else:
            url, params = target.fill(path), pairs
        token = ADMIN_KEY if path.startswith("/admin") else target.tenant.key
        try:
            r = target.client.get(url, params=params, headers={"Authorization": f"Bearer {token}"})
        except (httpx.InvalidURL, httpx.LocalProtocolError):
            return  # not a URL an HTTP client can send
        check(target.fill(path), r.status_code, r.headers.get("content-type", ""), r.content, url)

    _fuzz(run, examples(pytestconfig, 30))()
    assert_no_findings(target.fill(path))


@pytest.mark.parametrize("path", list(METERED) + ["/admin/v1/orgs"])
def test_content_length_lies(target: Target, path: str, pytestconfig: pytest.Config) -> None:
    """A declared length shorter or longer than the body (then the client stops sending),
    or not a number at all: a 4xx, or a closed connection; never a 5xx."""
    host, port = target.gw.url.removeprefix("http://").split(":")
    body = json.dumps(METERED.get(path, {"name": "cl"})).encode()
    admin = path.startswith("/admin")

    @given(declared=st.integers(min_value=0, max_value=2 * len(body)).map(str)
           | st.sampled_from(["-1", "abc", "1e3", "99999999999999999999", "", "10, 10"]))
    def run(declared: str) -> None:
        token = ADMIN_KEY if admin else target.tenant.key
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(head.encode() + body)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            while piece := s.recv(65536):
                answer += piece
        if not answer:
            return  # the server closed without answering (the body never came): fine
        status = int(answer.split(b" ", 2)[1])
        headers, _, rest = answer.partition(b"\r\n\r\n")
        ctype = next((line.split(b":", 1)[1].strip().decode() for line in headers.split(b"\r\n")
                      if line.lower().startswith(b"content-type:")), "")
        check(path, status, ctype, rest, declared)

    _fuzz(run, examples(pytestconfig, 25))()
    assert_no_findings(path)

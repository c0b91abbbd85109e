"""Test fixtures: the real gateway and the real simulator, as servers on 127.0.0.1.

Nothing of Kiln is mocked. One simulator and one gateway serve the whole
session; each test makes its own organisation and key through the admin
API, so tests do not share balances. Tests that need another configuration
start their own gateway with `start_gateway`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

ADMIN_KEY = "sk-kiln-admin-test-" + "x" * 32
QWEN = "qwen3-32b"  # the session catalog's models (catalog_toml)
OSS = "gpt-oss-120b"
QWEN_UPSTREAM = "Qwen/Qwen3-32B"  # the backend's name differs from the public id on purpose
HELLO = [{"role": "user", "content": "Hello!"}]
# One tool in each wire format: Chat's nested function, Responses' flat function, Anthropic's custom tool.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
WEATHER_RESPONSES = {
    "type": "function", "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": False,
}
WEATHER_ANTHROPIC = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def upstream(sim: "Sim", tag: str) -> dict[str, Any]:
    """The chat body the simulator received for the request tagged `tag` (it must have)."""
    return sim.received(tag)


def new_tag() -> str:
    """A unique marker for one request: its `sim.tag`, or text the simulator's rules match on."""
    return uuid.uuid4().hex


def wait_for(check: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"  # the machine's PostgreSQL (.ci/services starts it)


def drop_pg_schema(schema: str, dsn: str = PG_DSN) -> None:
    """Drop a test's PostgreSQL schema and everything in it (a no-op if it is not there)."""
    import asyncio

    import asyncpg

    async def drop() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await conn.close()

    asyncio.run(drop())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Sim:
    url: str
    proc: subprocess.Popen[str]
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=10)

    def stats(self) -> dict[str, Any]:
        return self.http.get("/sim/stats").json()

    def reset(self) -> None:
        self.http.post("/sim/stats/reset")

    def configure(self, **settings: Any) -> dict[str, Any]:
        return self.http.post("/sim/config", json=settings).json()

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get("/sim/requests").json()

    def last_body(self) -> dict[str, Any]:
        return self.requests()[-1]["body"]

    def tagged(self, tag: str) -> tuple[str, dict[str, Any]] | None:
        """(path, body) of the newest request whose `sim.tag` is `tag`, if it reached the simulator."""
        for entry in reversed(self.requests()):
            body = entry["body"]
            if isinstance(body, dict) and (body.get("sim") or {}).get("tag") == tag:
                return entry["path"], body
        return None

    def received(self, tag: str, path: str = "/v1/chat/completions") -> dict[str, Any]:
        """The body the simulator received for the request tagged `tag` (it must have)."""
        found = self.tagged(tag)
        assert found is not None, f"the request tagged {tag} never reached the model server"
        assert found[0] == path, found[0]
        return found[1]


def start_sim(*args: str, ns: Any = None) -> Sim:
    """A simulator subprocess; inside `ns` (an e2e.LoopbackNamespace) if given."""
    popen = ns.popen if ns is not None else subprocess.Popen
    proc = popen(
        [sys.executable, "-m", "kiln.sim", "--port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, f"simulator did not start: {line!r}"
    return Sim(line.rsplit(" ", 1)[-1].strip(), proc)


def stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(30)  # a gateway with workers waits for each to finish its graceful shutdown
    except subprocess.TimeoutExpired:
        kill_hard(proc)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (a gateway's workers), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_hard(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL a process and all its descendants at once, as if its machine died."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


@pytest.fixture(scope="session")
def sim() -> Iterator[Sim]:
    s = start_sim(
        "--model", QWEN_UPSTREAM, "--model", "gpt-oss-120b", "--model", "demo-model",
        "--reasoning-models", f"{QWEN_UPSTREAM},gpt-oss-120b",
    )
    yield s
    stop(s.proc)


# The session catalog's prices, USD per 1M tokens: input, cached input, output.
PRICES = {
    "qwen3-32b": (Decimal("0.10"), Decimal("0.05"), Decimal("0.30")),
    "gpt-oss-120b": (Decimal("0.05"), Decimal("0.025"), Decimal("0.0625")),
}


def catalog_cost(model: str, prompt: int, cached: int, completion: int, *, rounded: bool = True) -> Decimal:
    """What a request should cost at the catalog's prices, computed here independently of Kiln:
    rounded half-up to the nanodollar as billed, or exact."""
    p_in, p_cached, p_out = PRICES[model]
    usd = ((prompt - cached) * p_in + cached * p_cached + completion * p_out) / 10**6
    return usd.quantize(Decimal("1e-9"), rounding=ROUND_HALF_UP) if rounded else usd


def usage_cost(model: str, usage: dict[str, Any], *, rounded: bool = True) -> Decimal:
    """catalog_cost of an OpenAI-shaped usage object."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return catalog_cost(model, usage["prompt_tokens"], cached, usage["completion_tokens"], rounded=rounded)


def _prices(model: str) -> str:
    p_in, p_cached, p_out = PRICES[model]
    return f'prices = {{ input = "{p_in}", cached_input = "{p_cached}", output = "{p_out}" }}'


def catalog_toml(sim_url: str, extra: str = "") -> str:
    return f"""
[server]
keepalive_s = 0.5
backend_retry_s = 1

[limits]
rpm = 100000
concurrency = 64

[[models]]
id = "qwen3-32b"
family = "qwen3"
context_window = 32768
max_output_tokens = 8192
aliases = ["claude-opus-5-5"]
{_prices("qwen3-32b")}
capabilities = {{ tool_choice = ["auto", "none"], reasoning = true }}
[[models.backends]]
url = "{sim_url}/v1"
model = "{QWEN_UPSTREAM}"

[[models]]
id = "gpt-oss-120b"
family = "gpt-oss"
context_window = 131072
max_output_tokens = 32768
aliases = ["gpt-5"]
{_prices("gpt-oss-120b")}
capabilities = {{ tool_choice = ["auto", "none", "required", "named"], parallel_tool_calls = true, reasoning = true, response_format = true, image_input = true }}
[[models.backends]]
url = "{sim_url}/v1"

[[models]]
id = "offline-model"
context_window = 4096
prices = {{ input = "1", output = "2" }}
[[models.backends]]
url = "http://127.0.0.1:{free_port()}/v1"
{extra}
"""


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[str]
    data_dir: Path
    log: Path
    admin: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.admin = httpx.Client(
            base_url=self.url + "/admin/v1", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
        )

    def new_key(self, credits: str = "10", key_fields: dict[str, Any] | None = None, **org_fields: Any) -> "Tenant":
        """A fresh organisation, project and key: tests never share balances."""
        name = f"org-{time.monotonic_ns()}"
        org = self.admin.post("/orgs", json={"name": name, "credits": credits, **org_fields})
        assert org.status_code == 201, org.text
        project = self.admin.post("/projects", json={"org_id": org.json()["id"], "name": "p"})
        assert project.status_code == 201, project.text
        key = self.admin.post("/keys", json={"project_id": project.json()["id"], "name": "k", **(key_fields or {})})
        assert key.status_code == 201, key.text
        return Tenant(self, org.json()["id"], project.json()["id"], key.json()["id"], key.json()["key"])

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


@dataclass
class Tenant:
    gw: Gateway
    org_id: str
    project_id: str
    key_id: str
    key: str

    def openai(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gw.url + "/v1", api_key=self.key, max_retries=0, **kw)

    def http(self) -> httpx.Client:
        return self.gw.http(self.key)

    def usage(self) -> list[dict[str, Any]]:
        r = self.gw.admin.get("/usage", params={"key_id": self.key_id, "limit": 1000})
        assert r.status_code == 200, r.text
        return r.json()["data"]

    def org(self) -> dict[str, Any]:
        return self.gw.admin.get(f"/orgs/{self.org_id}").json()


def start_gateway(config_text: str, env: dict[str, str] | None = None, ns: Any = None,
                  args: tuple[str, ...] = (), data_dir: Path | None = None, **popen: Any) -> Gateway:
    """A gateway subprocess with this config and extra `kiln serve` args (e.g. --workers 2), its
    data in `data_dir` (a restart; default: a new temp dir); inside `ns` (an e2e.LoopbackNamespace)
    if given.

    Inside a namespace the test process cannot reach it: readiness is read from its log.
    """
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="kiln-test-"))
    config = data_dir / "kiln.toml"
    config.write_text(config_text)
    port = free_port()
    log = data_dir / "gateway.log"
    start = ns.popen if ns is not None else subprocess.Popen
    proc = start(
        [sys.executable, "-m", "kiln", "serve", "--config", str(config), "--port", str(port),
         "--data-dir", str(data_dir), *args],
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY, **(env or {})},
        text=True,
        **popen,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text()}")
        if ns is not None:
            if "Uvicorn running on" in log.read_text():
                return Gateway(url, proc, data_dir, log)
            time.sleep(0.1)
            continue
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Gateway(url, proc, data_dir, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"gateway did not start: {log.read_text()}")


@pytest.fixture(scope="session")
def gateway(sim: Sim) -> Iterator[Gateway]:
    gw = start_gateway(catalog_toml(sim.url))
    yield gw
    stop(gw.proc)


@pytest.fixture
def tenant(gateway: Gateway) -> Tenant:
    return gateway.new_key()


def assert_recorded_at_no_cost(tenant: Tenant, resp: httpx.Response, status: str = "error",
                               credits: str = "10") -> dict[str, Any]:
    """A failure that was not the client's: one event, cost 0, under the id the client received
    (the billing policy: a failure costs only what reached the client)."""
    gen_id = resp.headers["x-neocloud-generation-id"]
    event = wait_for(lambda: next((e for e in tenant.usage() if e["id"] == gen_id), None),
                     what="the usage event of the failed request")
    assert (event["status"], Decimal(event["cost"])) == (status, 0), event
    assert Decimal(tenant.org()["credits"]) == Decimal(credits)
    return event


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long soak variants of tests/reliability (also: KILN_SOAK=1)")

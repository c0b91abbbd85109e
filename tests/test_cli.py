"""The `kiln` command: `kiln admin ...` against a running gateway, and the demo mode of `kiln serve`."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import ADMIN_KEY, Gateway, Sim, catalog_toml, free_port, start_gateway, stop


def kiln_admin(gw: Gateway, *args: str, admin_key: str | None = ADMIN_KEY,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    if admin_key is not None:
        env["KILN_ADMIN_KEY"] = admin_key
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "admin", "--url", gw.url, *args],
        capture_output=True, text=True, timeout=60, env=env,
    )
    if check:
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
    return proc


def admin_json(gw: Gateway, *args: str) -> Any:
    return json.loads(kiln_admin(gw, *args, "--json").stdout)


def chat(gw: Gateway, key: str) -> httpx.Response:
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        return c.post("/v1/chat/completions",
                      json={"model": "qwen3-32b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20})


# -- kiln admin ------------------------------------------------------------------------------


def test_admin_cli_full_lifecycle(gateway: Gateway) -> None:
    name = f"cli-{time.monotonic_ns()}"
    org = admin_json(gateway, "orgs", "create", name, "--credits", "3", "--monthly-budget", "2",
                     "--concurrency-limit", "4")
    assert org["name"] == name and org["id"].startswith("org_")
    assert Decimal(org["credits"]) == 3 and Decimal(org["monthly_budget"]) == 2 and org["concurrency_limit"] == 4

    project = admin_json(gateway, "projects", "create", org["id"], "web")
    assert project["org_id"] == org["id"] and project["name"] == "web"
    projects = admin_json(gateway, "projects", "list", "--org-id", org["id"])
    assert [p["id"] for p in projects["data"]] == [project["id"]]

    created = kiln_admin(gateway, "keys", "create", project["id"], "--name", "ci", "--spend-limit", "1", "--json")
    key = json.loads(created.stdout)
    secret = key["key"]
    assert secret.startswith("sk-kiln-")
    assert created.stdout.count(secret) == 1, "the key is printed once"
    assert key["name"] == "ci" and Decimal(key["spend_limit"]) == 1
    listed = kiln_admin(gateway, "keys", "list", "--project-id", project["id"], "--json")
    assert secret not in listed.stdout
    assert [k["id"] for k in json.loads(listed.stdout)["data"]] == [key["id"]]

    r = chat(gateway, secret)
    assert r.status_code == 200, r.text
    gen_id = r.headers["x-neocloud-generation-id"]

    suspended = admin_json(gateway, "keys", "suspend", key["id"])
    assert suspended["status"] == "suspended"
    assert chat(gateway, secret).status_code == 403
    assert admin_json(gateway, "keys", "reactivate", key["id"])["status"] == "active"
    assert chat(gateway, secret).status_code == 200

    topped = admin_json(gateway, "orgs", "add-credits", org["id"], "10", "--note", "cli top-up")
    shown = admin_json(gateway, "orgs", "show", org["id"])
    assert Decimal(shown["total_granted"]) == 13
    assert Decimal(topped["credits"]) == Decimal(shown["credits"])
    assert shown["usage_events"] == 2
    assert Decimal(shown["total_granted"]) - Decimal(shown["credits"]) == Decimal(shown["total_spend"]) > 0

    usage = admin_json(gateway, "usage", "list", "--org-id", org["id"])
    assert len(usage["data"]) == 2
    assert gen_id in {e["id"] for e in usage["data"]}
    by_key = admin_json(gateway, "usage", "list", "--key-id", key["id"], "--limit", "1")
    assert len(by_key["data"]) == 1

    assert admin_json(gateway, "keys", "revoke", key["id"])["status"] == "revoked"
    assert chat(gateway, secret).status_code == 403
    again = kiln_admin(gateway, "keys", "reactivate", key["id"], check=False)
    assert again.returncode != 0 and "409" in again.stderr


def _columns(line: str) -> list[int]:
    """Where each word of a table line starts."""
    return [m.start() for m in re.finditer(r"\S+", line)]


def test_admin_cli_prints_tables_by_default(gateway: Gateway) -> None:
    name = f"cli-table-{time.monotonic_ns()}"
    created = kiln_admin(gateway, "orgs", "create", name, "--credits", "3.5").stdout
    assert not created.lstrip().startswith("{")
    fields = dict(line.split(None, 1) for line in created.splitlines())
    assert fields["name"] == name and fields["credits"] == "3.5" and fields["monthly_budget"] == "-"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", fields["created_at"])
    org_id = fields["id"]

    listed = kiln_admin(gateway, "orgs", "list").stdout.splitlines()
    header = listed[0]
    assert header.split()[:4] == ["ID", "NAME", "CREDITS", "MONTH_SPEND"]
    [row] = [line for line in listed if org_id in line]
    assert row.split()[:3] == [org_id, name, "3.5"]
    assert _columns(row)[:2] == _columns(header)[:2]  # left-aligned text columns line up
    credits_end = header.index("CREDITS") + len("CREDITS")
    assert row[:credits_end].endswith("3.5")  # numbers right-aligned under their header

    project_id = dict(line.split(None, 1) for line in
                      kiln_admin(gateway, "projects", "create", org_id, "web").stdout.splitlines())["id"]
    key_out = kiln_admin(gateway, "keys", "create", project_id, "--name", "tbl").stdout
    secret = re.search(r"^key\s+(sk-kiln-\S+)$", key_out, re.M).group(1)  # type: ignore[union-attr]
    assert key_out.count(secret) == 1 and "not shown again" in key_out
    assert len(secret) > 40 and "…" not in secret
    keys = kiln_admin(gateway, "keys", "list", "--project-id", project_id).stdout
    assert secret not in keys
    assert keys.splitlines()[0].split()[:5] == ["ID", "NAME", "PREFIX", "PROJECT_ID", "STATUS"]
    assert " active " in keys.splitlines()[1]
    empty = kiln_admin(gateway, "projects", "list", "--org-id", "org_nobody").stdout
    assert empty.splitlines() == ["ID  ORG_ID  NAME  CREATED_AT", "(none)"]
    # --json before the command works as after it
    before = json.loads(kiln_admin(gateway, "--json", "orgs", "show", org_id).stdout)
    assert before["id"] == org_id and before == admin_json(gateway, "orgs", "show", org_id)
    maintenance = kiln_admin(gateway, "maintenance", "show").stdout
    assert re.search(r"^active\s+no$", maintenance, re.M)


def test_admin_cli_usage_summary(gateway: Gateway) -> None:
    t = gateway.new_key()
    for _ in range(2):
        assert chat(gateway, t.key).status_code == 200
    events = t.usage()
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    cost = sum(Decimal(e["cost"]) for e in events)

    text = kiln_admin(gateway, "usage", "summary", "--by", "day,model", "--key-id", t.key_id).stdout.splitlines()
    assert text[0].split() == ["DAY", "MODEL", "REQUESTS", "PROMPT_TOKENS", "CACHED_TOKENS", "COMPLETION_TOKENS",
                               "REASONING_TOKENS", "COST"]
    [row] = text[1:]
    cells = row.split()
    assert cells[:3] == [today, "qwen3-32b", "2"] and Decimal(cells[-1]) == cost
    assert int(cells[3]) == sum(e["prompt_tokens"] for e in events)

    data = admin_json(gateway, "usage", "summary", "--by", "model", "--org-id", t.org_id)
    assert data["by"] == ["model"] and data["data"][0]["requests"] == 2 and Decimal(data["data"][0]["cost"]) == cost
    csv_out = kiln_admin(gateway, "usage", "summary", "--by", "day", "--key-id", t.key_id, "--csv").stdout
    assert csv_out.splitlines() == [
        "day,requests,prompt_tokens,cached_tokens,completion_tokens,reasoning_tokens,cost",
        f"{today},2,{cells[3]},{cells[4]},{cells[5]},{cells[6]},{cells[7]}",
    ]
    bad = kiln_admin(gateway, "usage", "summary", "--by", "colour", check=False)
    assert bad.returncode != 0 and "400" in bad.stderr


def test_admin_cli_set_limits(gateway: Gateway) -> None:
    org = admin_json(gateway, "orgs", "create", f"cli-set-{time.monotonic_ns()}", "--credits", "1")
    updated = admin_json(gateway, "orgs", "set", org["id"], "--monthly-budget", "9", "--rpm-limit", "5")
    assert Decimal(updated["monthly_budget"]) == 9 and updated["rpm_limit"] == 5
    project = admin_json(gateway, "projects", "create", org["id"], "p")
    key = admin_json(gateway, "keys", "create", project["id"])
    k = admin_json(gateway, "keys", "set", key["id"], "--spend-limit", "0.5", "--expires-at", "2099-01-01T00:00:00Z")
    assert Decimal(k["spend_limit"]) == Decimal("0.5") and k["expires_at"] == 4070908800


def test_admin_cli_lists_orgs(gateway: Gateway) -> None:
    t = gateway.new_key()
    orgs = admin_json(gateway, "orgs", "list")
    assert t.org_id in {o["id"] for o in orgs["data"]}


def test_admin_cli_errors_exit_nonzero_with_the_message(gateway: Gateway) -> None:
    proc = kiln_admin(gateway, "orgs", "show", "org_missing", check=False)
    assert proc.returncode != 0
    assert "404" in proc.stderr and "org_missing" in proc.stderr
    name = f"cli-dup-{time.monotonic_ns()}"
    kiln_admin(gateway, "orgs", "create", name)
    dup = kiln_admin(gateway, "orgs", "create", name, check=False)
    assert dup.returncode != 0 and "409" in dup.stderr
    bad = kiln_admin(gateway, "orgs", "add-credits", "org_missing", "ten", check=False)
    assert bad.returncode != 0 and ("400" in bad.stderr or "404" in bad.stderr)


def test_admin_cli_needs_the_admin_key(gateway: Gateway) -> None:
    missing = kiln_admin(gateway, "orgs", "list", admin_key=None, check=False)
    assert missing.returncode != 0 and "KILN_ADMIN_KEY" in missing.stderr
    wrong = kiln_admin(gateway, "orgs", "list", admin_key="sk-kiln-admin-wrong", check=False)
    assert wrong.returncode != 0 and "401" in wrong.stderr


def test_admin_cli_cannot_reach_a_dead_gateway() -> None:
    env = {**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY}
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "admin", "--url", f"http://127.0.0.1:{free_port()}", "orgs", "list"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert proc.returncode != 0 and "cannot reach" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_admin_cli_maintenance_on_show_off(sim: Sim) -> None:
    gw = start_gateway(catalog_toml(sim.url))  # its own gateway: maintenance is gateway-wide
    try:
        t = gw.new_key()
        on = admin_json(gw, "maintenance", "on", "2099-12-01T06:00:00Z", "--message", "Moving racks.")
        assert on["active"] is True
        r = chat(gw, t.key)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "Tue, 01 Dec 2099 06:00:00 GMT"
        assert "Moving racks." in r.json()["error"]["message"]
        assert admin_json(gw, "maintenance", "show")["active"] is True
        assert admin_json(gw, "maintenance", "off")["active"] is False
        assert chat(gw, t.key).status_code == 200
        assert httpx.get(gw.url + "/health").json()["status"] == "ok"
    finally:
        stop(gw.proc)


# -- demo mode --------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _hangup_by_default() -> None:
    """SIGHUP's default action in the gateway, as from a terminal: a test run under `nohup`
    would otherwise pass on its ignored SIGHUP, and the hangup case would wait in vain."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Demo:
    def __init__(self) -> None:
        self.cwd = Path(tempfile.mkdtemp(prefix="kiln-demo-cwd-"))
        self.data_dir = Path(tempfile.mkdtemp(prefix="kiln-demo-data-"))
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln", "serve", "--port", str(self.port), "--data-dir", str(self.data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=self.cwd, env=env,
            preexec_fn=_hangup_by_default,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.sim_pids: list[int] = []

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def read_until(self, pattern: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = "".join(self.output)
            if re.search(pattern, text, re.S):
                return text
            try:
                self.output.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
        raise AssertionError(f"no {pattern!r} in the demo output:\n{''.join(self.output)}")

    def terminate(self) -> int | None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


@pytest.fixture
def demo() -> Iterator[Demo]:
    d = Demo()
    yield d
    if d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait(10)
    for pid in d.sim_pids:  # never leave the demo simulator behind, whatever the test found
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _parse_curl(text: str) -> tuple[str, dict[str, str], bytes]:
    """The printed curl command: URL, headers and body, as a shell would pass them."""
    start = text.index("curl ")
    block = text[start:].split("\n\n")[0].replace("\\\n", " ")
    argv = shlex.split(block)
    assert argv[0] == "curl"
    url, headers, body = "", {}, b""
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "-H":
            name, _, value = argv[i + 1].partition(":")
            headers[name.strip()] = value.strip()
            i += 2
        elif a in ("-d", "--data", "--data-raw"):
            body = argv[i + 1].encode()
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            url = a
            i += 1
    return url, headers, body


def test_demo_mode_prints_credentials_and_a_working_curl(demo: Demo) -> None:
    text = demo.read_until(r"demo key.*?curl .*?-d '.*?'.*?python3.*?\nPY\n")
    m_admin = re.search(r"admin credential[^:]*:\s*(sk-kiln-admin-\S+)", text)
    m_key = re.search(r"demo key[^:]*:\s*(sk-kiln-\S+)", text)
    assert m_admin, text
    assert m_key, text
    admin_key, demo_key = m_admin.group(1), m_key.group(1)
    assert not demo_key.startswith("sk-kiln-admin-")
    assert re.search(r"SIMULATED|simulated", text), "the banner must say the demo model is simulated"
    sim_url = re.search(r"simulated[^\n]*?(http://127\.0\.0\.1:\d+)", text, re.I)
    demo.sim_pids = _children(demo.proc.pid)

    url, headers, body = _parse_curl(text)
    assert url == f"http://127.0.0.1:{demo.port}/v1/chat/completions"
    assert headers["Authorization"] == f"Bearer {demo_key}"
    r = httpx.post(url, headers=headers, content=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-neocloud-generation-id"].startswith("gen-")
    data = json.loads(r.content, parse_float=Decimal)
    assert data["choices"][0]["message"]["content"]
    assert data["usage"]["cost"] > 0
    assert data["model"] == "demo-model"

    base = f"http://127.0.0.1:{demo.port}"
    models = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {demo_key}"}).json()
    [entry] = [m for m in models["data"] if m["id"] == "demo-model"]
    assert entry["simulated"] is True
    assert "simulated" in entry["owned_by"]

    # The admin credential works, and the demo organisation was billed exactly once.
    admin = httpx.Client(base_url=base + "/admin/v1", headers={"Authorization": f"Bearer {admin_key}"})
    orgs = admin.get("/orgs").json()["data"]
    [org] = [o for o in orgs if o["name"] == "demo"]
    detail = admin.get(f"/orgs/{org['id']}").json()
    assert detail["usage_events"] == 1
    assert Decimal(detail["total_granted"]) - Decimal(detail["credits"]) == data["usage"]["cost"]
    admin.close()

    # The Python snippet targets the same gateway with the same key.
    assert f'base_url="{base}/v1"' in text and f'api_key="{demo_key}"' in text

    # Stopping the gateway stops its simulator too.
    assert demo.sim_pids, "the demo simulator should be a child of the gateway"
    rc = demo.terminate()
    assert rc is not None, "the gateway did not stop on SIGTERM"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in demo.sim_pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in demo.sim_pids), "the demo simulator outlived the gateway"
    if sim_url:
        with pytest.raises(httpx.HTTPError):
            httpx.get(sim_url.group(1) + "/health", timeout=1)


def test_demo_mode_second_start_shows_no_new_credentials(demo: Demo) -> None:
    """Credentials are shown once: a restart on the same data dir does not print new ones."""
    text = demo.read_until(r"demo key.*?curl ")
    demo_key = re.search(r"demo key[^:]*:\s*(sk-kiln-\S+)", text).group(1)  # type: ignore[union-attr]
    demo.sim_pids = _children(demo.proc.pid)
    demo.terminate()
    first_data = demo.data_dir

    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--port", str(port), "--data-dir", str(first_data)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=demo.cwd, env=env,
    )
    try:
        deadline = time.monotonic() + 30
        ok = False
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    ok = True
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert ok, "the second demo start did not come up"
        demo.sim_pids += _children(proc.pid)
        # The old demo key still works on the restarted gateway.
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       headers={"Authorization": f"Bearer {demo_key}"},
                       json={"model": "demo-model", "messages": [{"role": "user", "content": "again"}]}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate(timeout=10)
    assert "admin credential" not in out
    assert "demo key" not in out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGKILL], ids=["ctrl-c", "hangup", "kill"])
def test_demo_simulator_does_not_outlive_the_gateway(demo: Demo, sig: signal.Signals) -> None:
    """Ctrl-C (SIGINT) or a closed terminal (SIGHUP) on `kiln serve` must not leave `kiln sim` running."""
    demo.read_until(r"demo key.*?curl ")
    demo.sim_pids = _children(demo.proc.pid)
    assert demo.sim_pids
    demo.proc.send_signal(sig)
    try:
        demo.proc.wait(20)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the gateway did not stop on {sig.name}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in demo.sim_pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in demo.sim_pids), f"the demo simulator outlived the gateway ({sig.name})"

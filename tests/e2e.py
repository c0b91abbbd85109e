"""Real clients (Claude Code, Codex CLI) against Kiln, isolated from any network.

`npm_client()` installs a pinned npm package once into a cache outside the
checkout (so CI pays the download once per machine, not per run) and returns
the path of its binary. `LoopbackNamespace` holds a network namespace with
only `lo` up: the simulator, the gateway and the client all run inside it
(`ns.popen(...)`), so a client can reach nothing but 127.0.0.1 there. The
test process itself stays outside and reads results from files (the
gateway's SQLite ledger, the client's output).
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE = Path(os.environ.get("KILN_E2E_CACHE", Path.home() / ".cache" / "kiln-e2e"))


def npm_client(package: str, version: str, binary: str) -> Path:
    """Install `package@version` into the cache once; return node_modules/.bin/<binary>."""
    root = CACHE / f"{package.replace('/', '__')}@{version}"
    bin_path = root / "node_modules" / ".bin" / binary
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not bin_path.exists() or not (root / ".installed").exists():
            subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(root), f"{package}@{version}"],
                check=True, capture_output=True, timeout=900,
            )
            (root / ".installed").write_text(version)
    return bin_path


class LoopbackNamespace:
    """A network namespace with only loopback, kept alive by a sleeping holder process."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "3600"])
        deadline = time.monotonic() + 5
        while not Path(f"/proc/{self.holder.pid}/ns/net").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # unshare execs sleep after entering the namespace
        subprocess.run(self.prefix() + ["ip", "link", "set", "lo", "up"], check=True)

    def prefix(self) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", "--"]

    def popen(self, cmd: list[str], **kw: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.prefix() + cmd, **kw)

    def run(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(self.prefix() + cmd, **kw)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()

    def __enter__(self) -> "LoopbackNamespace":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# Run inside a namespace: script the simulator, create an organisation and a key, print the key.
_PROVISION = r"""
import json, sys, httpx
gateway, sim, rules, admin, name = sys.argv[1:]
httpx.post(sim + "/sim/config", json={"rules": json.loads(rules)}).raise_for_status()
api = httpx.Client(base_url=gateway + "/admin/v1", headers={"Authorization": "Bearer " + admin})
org = api.post("/orgs", json={"name": name, "credits": "10"}).json()
project = api.post("/projects", json={"org_id": org["id"], "name": "e2e"}).json()
print(api.post("/keys", json={"project_id": project["id"], "name": name}).json()["key"])
"""
_REQUESTS = "import sys, httpx; print(httpx.get(sys.argv[1] + '/sim/requests').text)"


@dataclass
class Turn:
    done: subprocess.CompletedProcess[str]
    upstream: list[dict[str, Any]]  # the chat bodies the simulator received for it


def provision(ns: LoopbackNamespace, gateway_url: str, sim_url: str, rules: list[dict[str, Any]],
              admin_key: str, name: str) -> str:
    """Script the simulator with `rules` and return a new Kiln key (all from inside the namespace)."""
    done = ns.run([sys.executable, "-c", _PROVISION, gateway_url, sim_url, json.dumps(rules), admin_key, name],
                  capture_output=True, text=True, check=True)
    return done.stdout.strip()


def upstream_bodies(ns: LoopbackNamespace, sim_url: str) -> list[dict[str, Any]]:
    """The chat bodies the simulator received, oldest first."""
    out = ns.run([sys.executable, "-c", _REQUESTS, sim_url], capture_output=True, text=True, check=True)
    return [e["body"] for e in json.loads(out.stdout) if e["path"] == "/v1/chat/completions"]


def ledger_rows(data_dir: Path) -> list[sqlite3.Row]:
    """The gateway's usage events, read from its SQLite file once its ledger journal is empty
    (journaled events are committed within milliseconds; this test cannot reach the gateway's
    HTTP reads, which would commit them at once)."""
    deadline = time.monotonic() + 10
    while any(p.stat().st_size for p in (data_dir / "journal").glob("*.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.01)
    with sqlite3.connect(data_dir / "kiln.db") as db:
        db.row_factory = sqlite3.Row
        return db.execute("SELECT * FROM usage_events ORDER BY created_at").fetchall()

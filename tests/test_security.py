"""Issue 9's security items: the admin credential can be rotated, the data directory and
the database are private to the gateway's user, /health tells strangers only its state,
and admin bodies are bounded like every other."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from conftest import ADMIN_KEY, Gateway, Sim, Tenant, catalog_toml, free_port, start_gateway, stop, wait_for


def _admin_status(gw: Gateway, key: str) -> int:
    return httpx.get(gw.url + "/admin/v1/orgs", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


def test_kiln_admin_key_replaces_the_bootstrap_credential(sim: Sim) -> None:
    first = start_gateway(catalog_toml(sim.url), env={"KILN_ADMIN_KEY": ""})
    try:
        found = wait_for(lambda: re.search(r"admin credential[^:]*:\s*(sk-kiln-admin-\S+)", first.log.read_text()),
                         timeout=10, what="the bootstrap admin credential")
        bootstrap = found.group(1)
        assert _admin_status(first, bootstrap) == 200
    finally:
        stop(first.proc)
    rotated = start_gateway(catalog_toml(sim.url), data_dir=first.data_dir)  # KILN_ADMIN_KEY=ADMIN_KEY
    try:
        assert _admin_status(rotated, bootstrap) == 401, "the bootstrap credential must stop working"
        assert _admin_status(rotated, ADMIN_KEY) == 200
    finally:
        stop(rotated.proc)
    unset = start_gateway(catalog_toml(sim.url), env={"KILN_ADMIN_KEY": ""}, data_dir=first.data_dir)
    try:  # the rotation is durable: unsetting the variable does not bring the old credential back
        assert _admin_status(unset, bootstrap) == 401
        assert _admin_status(unset, ADMIN_KEY) == 200
        assert unset.log.read_text().count("admin credential (shown once") == 1  # no new one printed
    finally:
        stop(unset.proc)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_data_directory_0700_and_database_0600(sim: Sim) -> None:
    root = Path(tempfile.mkdtemp(prefix="kiln-perm-"))
    os.chmod(root, 0o755)
    config = root / "kiln.toml"
    config.write_text(catalog_toml(sim.url))
    data = root / "new" / "data"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", "--config", str(config), "--port", str(port),
                             "--data-dir", str(data)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY}, preexec_fn=lambda: os.umask(0o022))
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=30, what="the gateway")
        assert _mode(data) == 0o700
        files = {p.name: _mode(p) for p in data.iterdir() if p.name.startswith("kiln.db")}
        assert {"kiln.db", "kiln.db-wal", "kiln.db-shm"} <= set(files), files
        assert all(mode == 0o600 for mode in files.values()), {k: oct(v) for k, v in files.items()}
    finally:
        stop(proc)


def test_health_tells_strangers_only_its_state(tenant: Tenant) -> None:
    gw = tenant.gw
    anonymous = httpx.get(gw.url + "/health").json()
    assert anonymous == {"status": "ok", "maintenance_until": None}
    with_key = httpx.get(gw.url + "/health", headers={"Authorization": f"Bearer {tenant.key}"}).json()
    assert with_key == anonymous, "an API key is not an admin credential"
    admin = gw.admin.get(gw.url + "/health").json()
    assert admin["status"] == "ok" and admin["models"]["qwen3-32b"] is True
    assert isinstance(admin["in_flight"], int)


def test_admin_bodies_are_bounded(gateway: Gateway) -> None:
    r = gateway.admin.post("/orgs", json={"name": "x" * (1 << 20)})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    # The unread rest of the body must not be read as the next request on this connection.
    assert r.headers.get("connection") == "close"

    def endless() -> object:  # 64 MiB, chunked: refused without reading it all
        for _ in range(1024):
            yield b"x" * 65536

    started = time.monotonic()
    try:
        r = gateway.admin.post("/orgs", content=endless(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text
    except httpx.HTTPError:
        pass  # the gateway answered 413 and closed while the client was still sending
    assert time.monotonic() - started < 10
    names = [o["name"] for o in gateway.admin.get("/orgs").json()["data"]]
    assert not any(len(n) > 1000 for n in names)

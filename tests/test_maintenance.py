"""Maintenance mode is kept in the store: a restarted gateway is still in maintenance."""

from __future__ import annotations

import time

import httpx

from conftest import Sim, catalog_toml, start_gateway, stop


def test_maintenance_survives_a_restart(sim: Sim) -> None:
    gw = start_gateway(catalog_toml(sim.url))
    until = time.time() + 3600
    try:
        t = gw.new_key()
        r = gw.admin.put("/maintenance", json={"until": until, "message": "Upgrading the disks."})
        assert r.status_code == 200 and r.json()["active"]
    finally:
        stop(gw.proc)
    again = start_gateway(catalog_toml(sim.url), data_dir=gw.data_dir)  # the same SQLite file
    try:
        with again.http(t.key) as c:
            r = c.post("/v1/chat/completions", json={"model": "qwen3-32b", "max_tokens": 3,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "Upgrading the disks." in r.json()["error"]["message"]
        assert r.headers["retry-after"]
        assert httpx.get(again.url + "/health").json()["status"] == "maintenance"
        assert again.admin.put("/maintenance", json={"until": None}).json()["active"] is False
    finally:
        stop(again.proc)

"""Every Redis URL the configuration accepts reaches Redis: redis:// (TCP), rediss:// (TLS,
verified) and unix:// (a socket file on the gateway's machine: the cheapest round trip for
workers that share one machine's Redis), with a database number and a password."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from conftest import catalog_toml, free_port, start_gateway, stop
from kiln.core.resp import Resp
from services import RedisServer


def _calls(url: str, *commands: tuple[object, ...]) -> list[Any]:
    async def run() -> list[Any]:
        redis = Resp(url, timeout_s=5)
        try:
            return [await redis.call(*command) for command in commands]
        finally:
            await redis.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def unix_redis() -> Any:
    server = RedisServer("--requirepass", "s3cret pass")
    server.options += ("--unixsocket", str(server.socket), "--unixsocketperm", "700")
    server.start()
    yield server
    server.stop()


def test_a_unix_socket_url_with_a_database_and_a_password(unix_redis: RedisServer) -> None:
    sock = unix_redis.socket
    assert _calls(f"unix://:s3cret%20pass@{sock}?db=3", ("SET", "k", "three"), ("GET", "k")) == ["OK", "three"]
    assert _calls(f"unix://:s3cret%20pass@{sock}", ("GET", "k")) == [None]  # database 0 by default
    assert _calls(f"unix://{sock}?db=3&password=s3cret%20pass", ("GET", "k")) == ["three"]  # redis-py's form
    with pytest.raises(ConnectionError, match="NOAUTH|AUTH|auth"):
        _calls(f"unix://{sock}?db=3", ("GET", "k"))


def test_a_gateway_admits_through_redis_on_a_unix_socket(unix_redis: RedisServer, sim: Any) -> None:
    env = {"KILN_REDIS_URL": f"unix://:s3cret%20pass@{unix_redis.socket}?db=5", "KILN_REDIS_PREFIX": "kiln-unix"}
    gw = start_gateway(catalog_toml(sim.url), env=env)
    try:
        tenant = gw.new_key(credits="5")
        r = tenant.http().post("/v1/chat/completions", json={"model": "qwen3-32b", "max_tokens": 8,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert _calls(f"unix://:s3cret%20pass@{unix_redis.socket}?db=5", ("DBSIZE",))[0] > 0  # admission's keys
    finally:
        stop(gw.proc)


def test_a_tls_url_is_verified() -> None:
    tls_port = free_port()
    server = RedisServer()
    server.options = server.tls_options(tls_port)
    server.start()
    try:
        ca = server.dir / "ca.crt"
        assert _calls(f"rediss://localhost:{tls_port}/2?ssl_ca_certs={ca}", ("SET", "t", "1"), ("PING",)) == \
            ["OK", "PONG"]
        with pytest.raises(ConnectionError, match="certificate"):  # not signed by a CA the system trusts
            _calls(f"rediss://localhost:{tls_port}/0", ("PING",))
    finally:
        server.stop()


@pytest.mark.parametrize(("url", "says"), [
    ("http://:hunter2@127.0.0.1:6379/0", "scheme 'http'"),
    ("redis://:hunter2@127.0.0.1:63x9/0", "port is not a number"),
    ("redis://:hunter2@127.0.0.1:6379/zero", "database is not a number"),
    ("unix://:hunter2@", "socket file's path"),
])
def test_a_url_that_names_no_redis_is_a_configuration_error_that_keeps_its_password(sim: Any, url: str,
                                                                                     says: str) -> None:
    with pytest.raises(RuntimeError, match="redis_url") as refused:
        start_gateway(catalog_toml(sim.url), env={"KILN_REDIS_URL": url})
    assert says in str(refused.value) and "hunter2" not in str(refused.value)
    assert "Traceback" not in str(refused.value)


def test_every_scheme_the_configuration_takes_opens_a_client() -> None:
    """The configuration's check and the client agree: no URL passes one and fails the other."""
    for url in ("redis://127.0.0.1:6379/0", "rediss://cache.example.com:6380/1", "unix:///run/redis/redis.sock?db=2"):
        Resp(url)
    with pytest.raises(ValueError):
        Resp("http://127.0.0.1:6379/0")

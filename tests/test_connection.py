"""Kiln's HTTP/1.1 server side (kiln.connection) on the wire: what clients and proxies send that the
SDKs in the other tests do not, spoken over a raw socket to a real gateway."""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from conftest import Gateway, Sim, Tenant, catalog_toml, free_port, start_gateway, stop
from kiln.connection import ConnectionLimits, protocol_for

QWEN = "qwen3-32b"


class _File(io.BufferedReader):
    def close(self) -> None:  # http.client closes the file after each body: keep it for the next answer
        pass


class _Sock:
    def __init__(self, f: io.BufferedReader) -> None:
        self.f = f

    def makefile(self, *_: Any, **__: Any) -> io.BufferedReader:
        return self.f


class Wire:
    """A raw connection: bytes out, answers parsed one after another from one buffered reader."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.file = _File(self.sock.makefile("rb", buffering=0))  # type: ignore[arg-type]

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(self, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
        resp = http.client.HTTPResponse(_Sock(self.file), method=method)  # type: ignore[arg-type]
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()

    def closed(self) -> bool:
        return self.file.read(1) == b""

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def wire(gateway: Gateway) -> Iterator[Wire]:
    w = Wire(gateway.url)
    yield w
    w.close()


def chat(key: str, extra: bytes = b"", body: bytes | None = None) -> bytes:
    body = body or json.dumps({"model": QWEN, "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 5}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer %b\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n%b\r\n%b"
            % (key.encode(), len(body), extra, body))


def test_pipelined_requests_are_answered_in_order(wire: Wire, tenant: Tenant) -> None:
    wire.send(b"GET /health HTTP/1.1\r\nHost: kiln\r\n\r\n" + chat(tenant.key)
              + b"GET /v1/models HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer %b\r\n\r\n" % tenant.key.encode())
    status, headers, body = wire.answer()
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert headers["server"] == "kiln"
    status, headers, body = wire.answer("POST")
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] > 0
    assert headers["x-neocloud-generation-id"].startswith("gen-")
    status, _, body = wire.answer()
    assert status == 200 and QWEN in [m["id"] for m in json.loads(body)["data"]]


def test_expect_100_continue_gets_its_interim_answer_before_the_body_is_sent(wire: Wire, tenant: Tenant) -> None:
    request = chat(tenant.key, extra=b"Expect: 100-continue\r\n")
    head, body = request.split(b"\r\n\r\n", 1)
    wire.send(head + b"\r\n\r\n")
    assert wire.file.read(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
    wire.send(body)
    status, _, answer = wire.answer("POST")
    assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] > 0


def test_a_chunked_request_body_is_read_whole(wire: Wire, tenant: Tenant) -> None:
    body = json.dumps({"model": QWEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}).encode()
    pieces = [body[:7], body[7:30], body[30:]]
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    wire.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer %b\r\n"
              b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n%b" % (tenant.key.encode(), chunked))
    status, _, answer = wire.answer("POST")
    assert status == 200 and json.loads(answer)["object"] == "chat.completion"


def test_head_has_no_body_and_the_connection_goes_on(wire: Wire) -> None:
    wire.send(b"HEAD /health HTTP/1.1\r\nHost: kiln\r\n\r\nGET /health HTTP/1.1\r\nHost: kiln\r\n\r\n")
    status, headers, body = wire.answer("HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 0
    status, _, body = wire.answer()
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_http_1_0_is_answered_then_closed(wire: Wire) -> None:
    wire.send(b"GET /health HTTP/1.0\r\n\r\n")
    status, headers, body = wire.answer()
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert headers.get("connection") == "close" and wire.closed()


def test_connection_close_from_the_client_closes_after_the_answer(wire: Wire, tenant: Tenant) -> None:
    wire.send(chat(tenant.key, extra=b"Connection: close\r\n"))
    status, headers, _ = wire.answer("POST")
    assert status == 200 and headers.get("connection") == "close" and wire.closed()


def test_bytes_after_a_closing_request_do_not_spoil_its_answer(wire: Wire, tenant: Tenant) -> None:
    wire.send(chat(tenant.key, extra=b"Connection: close\r\n") + b"GET /health HTTP/1.1\r\nHost: kiln\r\n\r\n")
    status, headers, body = wire.answer("POST")
    assert status == 200 and json.loads(body)["object"] == "chat.completion"
    assert headers.get("connection") == "close" and wire.closed()


def test_a_stream_is_chunked_and_the_connection_serves_the_next_request(wire: Wire, tenant: Tenant) -> None:
    body = json.dumps({"model": QWEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                       "stream": True}).encode()
    wire.send(chat(tenant.key, body=body) + b"GET /health HTTP/1.1\r\nHost: kiln\r\n\r\n")
    status, headers, raw = wire.answer("POST")
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert headers["content-type"].startswith("text/event-stream") and raw.endswith(b"data: [DONE]\n\n")
    status, _, body = wire.answer()
    assert status == 200 and json.loads(body)["status"] == "ok"


def _login_cookie(url: str, proto: bytes | None) -> str:
    w = Wire(url)
    try:
        forwarded = b"X-Forwarded-Proto: %b\r\n" % proto if proto else b""
        w.send(b"GET /console/login HTTP/1.1\r\nHost: kiln\r\n%b\r\n" % forwarded)
        status, headers, _ = w.answer()
        assert status == 200
        return headers["set-cookie"]
    finally:
        w.close()


def test_x_forwarded_proto_counts_from_a_trusted_proxy_only(gateway: Gateway, sim: Sim) -> None:
    """The console's cookies are Secure over HTTPS, which a TLS-terminating proxy on 127.0.0.1 (trusted
    by default, as FORWARDED_ALLOW_IPS says) reports in X-Forwarded-Proto; from anyone else it is ignored."""
    assert "Secure" not in _login_cookie(gateway.url, None)
    assert "Secure" in _login_cookie(gateway.url, b"https")
    assert "Secure" not in _login_cookie(gateway.url, b"gopher")
    other = start_gateway(catalog_toml(sim.url), env={"FORWARDED_ALLOW_IPS": "10.1.2.3, 192.168.0.0/16"})
    try:
        assert "Secure" not in _login_cookie(other.url, b"https")
    finally:
        stop(other.proc)


@pytest.fixture
def header_echo() -> Iterator[str]:
    """A tiny app served by Kiln's HTTP/1.1 protocol under uvicorn on a real socket: it answers with
    the response header named by the request's `X-Name` and `X-Value` (hex), as an app might
    get one wrong."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        asked = dict(scope["headers"])
        header = (bytes.fromhex(asked[b"x-name"].decode()), bytes.fromhex(asked[b"x-value"].decode()))
        await send({"type": "http.response.start", "status": 200, "headers": [header, (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", lifespan="off", log_level="critical",
                            http=protocol_for(app, ConnectionLimits()))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the header echo app did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.mark.parametrize(("name", "value", "sent"), [
    (b"x-ok", b"plain", True),
    (b"X-Tab", b"a\tb", True),
    (b"x-utf8", "café".encode(), True),  # obs-text in a value, as HTTP allows
    (b"x-symbols!#$%&'*+.^_`|~", b"1", True),  # every tchar
    (b"bad name", b"1", False),
    (b"bad:name", b"1", False),
    (b"bad/name", b"1", False),  # not a tchar (RFC 9110)
    (b"bad\x80name", b"1", False),
    (b"x-split", b"a\r\nInjected: 1", False),  # response splitting
    (b"x-nul", b"a\x00b", False),
    (b"x-del", b"a\x7fb", False),
])
def test_a_response_header_http_does_not_allow_is_never_sent(header_echo: str, name: bytes, value: bytes,
                                                              sent: bool) -> None:
    w = Wire(header_echo)
    try:
        w.send(b"GET / HTTP/1.1\r\nHost: kiln\r\nX-Name: %b\r\nX-Value: %b\r\n\r\n" % (name.hex().encode(),
                                                                                        value.hex().encode()))
        if sent:
            status, headers, body = w.answer()
            assert (status, body) == (200, b"ok")
            assert headers[name.decode().lower()] == value.decode("latin-1")
        else:  # the connection closes with nothing of that response on it
            assert w.file.read() == b""
    finally:
        w.close()

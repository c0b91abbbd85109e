"""Connection-level floods without credentials: real clients are still served.

Slowloris (hundreds of connections sending a header byte a second), header floods (a
16 MiB header, thousands of headers, many unfinished 8 MiB heads at once) and idle
connections beyond the default open-file limit of 1,024. While each runs, a real client
asks GET /v1/models and a chat completion and must be answered within a bound.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import orjson
import pytest

from conftest import Gateway, Sim, Tenant, catalog_toml, start_gateway, stop
from reliability.harness import observe

HEADER_TIMEOUT_S = 2
SERVED_WITHIN_S = 3.0  # a real request during a flood, on a loaded machine


def _raise_own_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 <= hard or (soft < hard and hard != resource.RLIM_INFINITY):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))


def _config(sim: Sim, extra: str = "", header_timeout_s: float = HEADER_TIMEOUT_S) -> str:
    return catalog_toml(sim.url).replace("[server]\n", f"[server]\nheader_timeout_s = {header_timeout_s}\n{extra}", 1)


@pytest.fixture(scope="module")
def flood_gw(sim: Sim) -> Iterator[Gateway]:
    gw = start_gateway(_config(sim))
    yield gw
    stop(gw.proc)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Prober:
    """A real client asking every 0.3 s while a flood runs: its slowest answer and failures."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        chat = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        while not self._stop.is_set():
            for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions", chat)):
                started = time.monotonic()
                try:
                    with self.tenant.http() as c:
                        r = c.request(method, path, json=body, timeout=SERVED_WITHIN_S * 3)
                    if r.status_code != 200:
                        self.failures.append(f"{path}: {r.status_code}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{path}: {type(exc).__name__}")
                self.latencies.append(time.monotonic() - started)
            self._stop.wait(0.3)

    def __enter__(self) -> "Prober":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def check(self) -> dict[str, Any]:
        result = {"probes": len(self.latencies), "slowest_s": round(max(self.latencies, default=0), 3),
                  "failures": self.failures[:5]}
        assert self.latencies and not self.failures, result
        assert max(self.latencies) <= SERVED_WITHIN_S, result
        return result


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.setblocking(False)
    return s


def _closed_by_server(s: socket.socket) -> bool:
    """True once the server closed it (EOF or reset), reading away any response it sent."""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slowloris_connections_are_closed_and_real_clients_served(flood_gw: Gateway) -> None:
    tenant = flood_gw.new_key()
    conns = [_connect(flood_gw.url) for _ in range(300)]
    for s in conns:
        s.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    started = time.monotonic()
    closed_at: dict[int, float] = {}
    with Prober(tenant) as prober:
        while time.monotonic() - started < HEADER_TIMEOUT_S + 4 and len(closed_at) < len(conns):
            for i, s in enumerate(conns):
                if i in closed_at:
                    continue
                if _closed_by_server(s):
                    closed_at[i] = time.monotonic() - started
                    continue
                try:
                    s.send(b"a")  # one header byte a second
                except OSError:
                    closed_at[i] = time.monotonic() - started
            time.sleep(1.0)
    for s in conns:
        s.close()
    probes = prober.check()
    observe("flood:slowloris", connections=len(conns), closed=len(closed_at),
            last_closed_s=round(max(closed_at.values(), default=-1), 2), header_timeout_s=HEADER_TIMEOUT_S, **probes)
    assert len(closed_at) == len(conns), f"{len(conns) - len(closed_at)} slowloris connections still open"
    assert max(closed_at.values()) <= HEADER_TIMEOUT_S + 3


def _head_of_size(size: int, path: bytes = b"/v1/models") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n"


def _send_and_read(url: str, data: bytes) -> tuple[bytes, int]:
    """Send as much of `data` as the server takes; return what it answered and how much was sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        sent = 0
        try:
            while sent < len(data):
                sent += s.send(data[sent:sent + (1 << 16)])
        except OSError:
            pass
        answer = b""
        try:
            while True:
                piece = s.recv(65536)
                if not piece:
                    break
                answer += piece
        except OSError:
            pass
    return answer, sent


def test_a_16_mib_header_is_refused(flood_gw: Gateway) -> None:
    tenant = flood_gw.new_key()
    before = rss_mb(flood_gw.proc.pid)
    started = time.monotonic()
    answer, sent = _send_and_read(flood_gw.url, _head_of_size(16 << 20))
    seconds = time.monotonic() - started
    after = rss_mb(flood_gw.proc.pid)
    observe("flood:16MiB header", sent_bytes=sent, answer=answer[:200].decode("latin-1"), seconds=round(seconds, 2),
            rss_before_mb=round(before), rss_after_mb=round(after))
    assert answer.startswith(b"HTTP/1.1 431") or sent < (16 << 20), answer[:200]
    assert after - before < 64, (before, after)
    with tenant.http() as c:
        assert c.get("/v1/models").status_code == 200


@pytest.mark.parametrize("path,shape", [(b"/v1/models", "openai"), (b"/v1/messages", "anthropic")])
def test_too_many_headers_get_a_431_in_the_callers_protocol(flood_gw: Gateway, path: bytes, shape: str) -> None:
    head = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(2000)) + b"\r\n"
    answer, _ = _send_and_read(flood_gw.url, head)
    status_line, _, rest = answer.partition(b"\r\n")
    observe("flood:2000 headers", path=path.decode(), answer=answer[:300].decode("latin-1"))
    assert status_line.startswith(b"HTTP/1.1 431"), answer[:300]
    body = orjson.loads(rest.split(b"\r\n\r\n", 1)[1])
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["code"] == "request_header_too_large"


def test_many_unfinished_8_mib_heads_hold_little_memory(flood_gw: Gateway) -> None:
    tenant = flood_gw.new_key()
    before = rss_mb(flood_gw.proc.pid)
    results: list[tuple[bytes, int]] = []
    head = _head_of_size(8 << 20)[: -4]  # never finished

    def one() -> None:
        results.append(_send_and_read(flood_gw.url, head))

    threads = [threading.Thread(target=one) for _ in range(24)]
    with Prober(tenant) as prober:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    peak = rss_mb(flood_gw.proc.pid)
    probes = prober.check()
    refused = sum(1 for answer, _ in results if answer.startswith(b"HTTP/1.1 431"))
    observe("flood:24 unfinished 8MiB heads", refused_431=refused, rss_before_mb=round(before),
            rss_after_mb=round(peak), **probes)
    assert len(results) == 24
    assert peak - before < 64, (before, peak)


def _limit_files_to_1024() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def _soft_file_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc")


def _idle_flood(gw: Gateway, count: int, check: Callable[[], None] | None = None) -> dict[str, Any]:
    tenant = gw.new_key()
    conns = []
    try:
        with Prober(tenant) as prober:
            for _ in range(count):
                try:
                    conns.append(_connect(gw.url))
                except OSError:
                    break
            time.sleep(1.0)
        probes = prober.check()
    finally:
        for s in conns:
            s.close()
    return {"idle_connections": len(conns), **probes}


def test_idle_connections_beyond_1024_do_not_break_real_clients(sim: Sim) -> None:
    """Started with a soft open-file limit of 1,024: the gateway raises it, and 1,100 idle
    connections do not stop it serving."""
    _raise_own_file_limit()
    gw = start_gateway(_config(sim, header_timeout_s=30),
                       preexec_fn=_limit_files_to_1024)
    try:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        soft = _soft_file_limit(gw.proc.pid)
        result = _idle_flood(gw, 1100)
        observe("flood:1100 idle connections", gateway_soft_file_limit=soft, hard_limit=hard, **result)
        assert soft == hard or soft > 1100 * 2, soft
        assert result["idle_connections"] == 1100
    finally:
        stop(gw.proc)


def test_over_the_connection_cap_the_longest_idle_make_room(sim: Sim) -> None:
    gw = start_gateway(_config(sim, "max_connections = 100\n"))
    try:
        result = _idle_flood(gw, 300)
        observe("flood:300 idle connections, cap 100", **result)
        assert result["idle_connections"] == 300
    finally:
        stop(gw.proc)


@pytest.mark.parametrize("path,shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")])
def test_a_slow_body_gets_a_408_in_the_callers_protocol(sim: Sim, path: str, shape: str) -> None:
    gw = start_gateway(_config(sim, "body_timeout_s = 2\n"))
    try:
        tenant = gw.new_key()
        host, port = gw.url.removeprefix("http://").split(":")
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {tenant.key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
        started = time.monotonic()
        answer = b""
        with socket.create_connection((host, int(port)), timeout=15) as s:
            s.sendall(head)
            s.setblocking(False)
            while time.monotonic() - started < 12 and b"\r\n\r\n" not in answer:
                try:
                    s.send(b" ")  # a byte a second
                except OSError:
                    break
                time.sleep(1.0)
                try:
                    answer += s.recv(65536)
                except BlockingIOError:
                    pass
                except OSError:
                    break
            time.sleep(0.3)
            s.setblocking(True)
            try:
                answer += s.recv(65536)
            except OSError:
                pass
        seconds = time.monotonic() - started
        observe("flood:slow body", path=path, seconds=round(seconds, 2), answer=answer[:300].decode("latin-1"))
        assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
        assert seconds < 2 + 4
        head, rest = answer.split(b"\r\n\r\n", 1)
        # The unread rest of the body must not be taken for the next request's head: closed.
        assert b"connection: close" in head.lower() and b"HTTP/1.1" not in rest, answer
        body = orjson.loads(rest)
        assert (body["type"] == "error") if shape == "anthropic" else (body["error"]["code"] == "request_timeout")
    finally:
        stop(gw.proc)

"""kiln.client against real sockets: servers on 127.0.0.1 that answer well, badly, slowly or not at all.

Everything the gateway does with a backend goes through this client; its mapping to the
gateway's errors and status codes is tested end to end (tests/reliability, test_failures).
These tests pin what only shows at the socket: keep-alive reuse and its race, the pool's
limit, flow control, every way an answer can be framed or broken, and TLS.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kiln import client
from kiln.client import BrokenAnswer, ConnectFailed, Pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 20))


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's body (the client always sends Content-Length); b"" once the client has gone."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return b""
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


class Server:
    """An asyncio TCP server whose every connection runs `handler`; counts connections."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler, self.tls = handler, tls
        self.connections = 0
        self.open = self.most_open = 0
        self.lost = asyncio.Event()

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, *_: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            self.lost.set()
            writer.close()


async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while body := await read_request(reader):
        writer.write(ok(b'{"echo":' + body + b"}"))
        await writer.drain()


async def one_by_one(server: Server, n: int, limit: int = 1) -> list[tuple[int, bytes]]:
    """`n` requests (bodies 0, 1, ...) one after another on a pool of `limit`: statuses and bodies."""
    pool = Pool(server.url, limit, 1.0)
    try:
        answers = []
        for i in range(n):
            resp = await pool.request("POST", "/chat/completions", {"Content-Type": "application/json"}, b"%d" % i)
            answers.append((resp.status, await resp.read(1000)))
        return answers
    finally:
        pool.close()


def test_connections_are_kept_alive_and_reused() -> None:
    async def main() -> None:
        async with Server(answer_each) as server:
            assert await one_by_one(server, 5, limit=4) == [(200, b'{"echo":%d}' % i) for i in range(5)]
            assert server.connections == 1

    run(main())


def test_a_kept_alive_connection_closed_as_the_request_went_is_retried_once_on_a_new_one() -> None:
    """The keep-alive race: the server closes an idle connection just as a request is sent on it.
    Nothing reached the model, so the request goes again on a fresh connection."""
    async def one_answer_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(ok())
        await writer.drain()
        await read_request(reader)  # the next request on this connection: dropped unanswered

    async def main() -> None:
        async with Server(one_answer_per_connection) as server:
            assert await one_by_one(server, 3, limit=4) == [(200, b'{"ok":true}')] * 3
            assert server.connections == 3

    run(main())


def test_a_fresh_connection_closed_unanswered_is_an_error_not_a_retry() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def main() -> None:
        async with Server(drop) as server:
            pool = Pool(server.url, 4, 1.0)
            with pytest.raises(BrokenAnswer, match="before answering"):
                await pool.request("POST", "/x", {}, b"{}")
            assert server.connections == 1
            pool.close()

    run(main())


def test_the_pool_opens_at_most_its_limit_and_the_rest_wait_their_turn() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            await asyncio.sleep(0.05)
            writer.write(ok())
            await writer.drain()

    async def main() -> None:
        async with Server(slow) as server:
            pool = Pool(server.url, 2, 1.0)

            async def call() -> bytes:
                resp = await pool.request("POST", "/x", {}, b"{}")
                return await resp.read(100)

            assert await asyncio.gather(*(call() for _ in range(7))) == [b'{"ok":true}'] * 7
            assert server.most_open == 2 and server.connections == 2
            pool.close()

    run(main())


def test_a_caller_cancelled_while_waiting_for_a_connection_leaves_the_pool_whole() -> None:
    release = asyncio.Event

    async def main() -> None:
        gate = release()

        async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await read_request(reader):
                await gate.wait()
                writer.write(ok())
                await writer.drain()

        async with Server(held) as server:
            pool = Pool(server.url, 1, 1.0)
            first = asyncio.ensure_future(pool.request("POST", "/x", {}, b"{}"))
            waiting = asyncio.ensure_future(pool.request("POST", "/x", {}, b"{}"))
            await asyncio.sleep(0.05)
            waiting.cancel()
            gate.set()
            assert await (await first).read(100) == b'{"ok":true}'
            resp = await pool.request("POST", "/x", {}, b"{}")  # the one connection is free again
            assert await resp.read(100) == b'{"ok":true}'
            assert server.connections == 1
            pool.close()

    run(main())


def test_closing_an_unfinished_answer_closes_its_connection() -> None:
    """How a model server learns that nobody wants the rest of the generation."""
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n")
        while True:
            writer.write(b"d\r\ndata: token\n\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async def main() -> None:
        async with Server(endless) as server:
            pool = Pool(server.url, 1, 1.0)
            resp = await pool.request("POST", "/x", {}, b"{}", idle_s=1.0)
            assert (await resp.piece()).startswith(b"data: token")
            resp.close()
            await asyncio.wait_for(server.lost.wait(), 2)
            assert server.open == 0
            pool.close()

    run(main())


def _stream_then(tail: Handler) -> Handler:
    """A server whose every answer is a stream's last event, then `tail` (the message's end, or not)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"e\r\ndata: [DONE]\n\n\r\n")
            await writer.drain()
            await tail(reader, writer)
    return handler


async def _ended_streams(server: Server, n: int) -> Pool:
    """`n` streams one after another, each closed as ended once its last event is read."""
    pool = Pool(server.url, 4, 1.0)
    for _ in range(n):
        resp = await pool.request("POST", "/x", {}, b"{}", idle_s=1.0)
        assert (await resp.piece()).endswith(b"data: [DONE]\n\n")
        resp.close(ended=True)
        await asyncio.sleep(0.1)  # the end comes meanwhile (a request sent before it takes another connection)
    return pool


@pytest.mark.parametrize("late", [b"0\r\n\r\n", b"5\r\nextra\r\n0\r\n\r\n"], ids=["end", "more then end"])
def test_a_stream_closed_as_ended_keeps_its_connection_once_its_message_ends(late: bytes) -> None:
    """A stream's last event comes before the end of its HTTP message: the connection waits for
    that end off the caller's path (anything else that comes first is dropped) and serves the
    next request."""
    async def later(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.02)
        writer.write(late)
        await writer.drain()

    async def main() -> None:
        async with Server(_stream_then(later)) as server:
            pool = await _ended_streams(server, 5)
            assert server.connections == 1
            pool.close()

    run(main())


def test_a_stream_closed_as_ended_whose_message_never_ends_loses_its_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client closes the connection

    async def main() -> None:
        async with Server(_stream_then(never)) as server:
            first = await _ended_streams(server, 1)
            await asyncio.wait_for(server.lost.wait(), 2)  # closed after SETTLE_S
            assert server.open == 0
            second = await _ended_streams(server, 1)
            assert server.connections == 2
            first.close()
            second.close()

    monkeypatch.setattr(client, "SETTLE_S", 0.1)
    run(main())


def test_a_stream_read_slowly_holds_a_bounded_amount_in_memory() -> None:
    """Flow control: the socket stops being read while the caller is behind."""
    total = 16 * 1024 * 1024

    async def firehose(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        block = b"x" * 65536
        for _ in range(total // len(block)):
            writer.write(block)
            await writer.drain()

    async def main() -> None:
        async with Server(firehose) as server:
            pool = Pool(server.url, 1, 1.0)
            resp = await pool.request("POST", "/x", {}, b"{}", idle_s=2.0)
            got, largest = 0, 0
            while piece := await resp.piece():
                got += len(piece)
                largest = max(largest, len(piece))
                await asyncio.sleep(0.002)
            assert got == total
            assert largest <= client.HIGH_WATER + 256 * 1024, largest
            resp.close()
            pool.close()

    run(main())


@pytest.mark.parametrize("framing", ["content-length", "chunked", "until-close"])
def test_every_framing_of_a_body_is_read_whole(framing: str) -> None:
    body = b"z" * 300_000

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if framing == "content-length":
            writer.write(ok(body))
        elif framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(body), 70_000):
                part = body[i:i + 70_000]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
            writer.close()
        await writer.drain()

    async def main() -> None:
        async with Server(answer) as server:
            pool = Pool(server.url, 1, 1.0)
            resp = await pool.request("POST", "/x", {}, b"{}")
            assert await resp.read(10**6) == body
            pool.close()

    run(main())


def test_an_informational_answer_before_the_answer_is_skipped() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + ok())
            await writer.drain()

    async def main() -> None:
        async with Server(answer) as server:
            assert await one_by_one(server, 2) == [(200, b'{"ok":true}')] * 2
            assert server.connections == 1

    run(main())


@pytest.mark.parametrize("wire,message", [
    (b"SPDY/9 what\r\n\r\n", "not HTTP"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "mid-answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\n\x1f\x8b\x08\x00", "compressed"),
])
def test_a_broken_answer_is_a_broken_answer(wire: bytes, message: str) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(wire)
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with Server(answer) as server:
            pool = Pool(server.url, 1, 1.0)
            with pytest.raises(BrokenAnswer, match=message):
                resp = await pool.request("POST", "/x", {}, b"{}")
                await resp.read(100)
            pool.close()

    run(main())


def test_bytes_after_an_answer_cost_the_connection_not_the_answer() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(ok(b"{}") + b"HTTP/1.1 200 OK\r\n\r\n")
            await writer.drain()

    async def main() -> None:
        async with Server(answer) as server:
            assert await one_by_one(server, 2) == [(200, b"{}")] * 2
            assert server.connections == 2

    run(main())


def test_a_silent_stream_times_out_after_its_idle_limit() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(5)

    async def main() -> None:
        async with Server(silent) as server:
            pool = Pool(server.url, 1, 1.0)
            resp = await pool.request("POST", "/x", {}, b"{}", idle_s=0.2)
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await resp.piece()
            assert asyncio.get_running_loop().time() - started < 1.0
            resp.close()
            pool.close()

    run(main())


def test_a_stream_slower_in_all_than_its_idle_limit_but_never_silent_that_long_goes_on() -> None:
    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(8):
            await asyncio.sleep(0.1)
            writer.write(b"2\r\nok\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await read_request(reader)

    async def main() -> None:
        async with Server(drip) as server:
            pool = Pool(server.url, 1, 1.0)
            resp = await pool.request("POST", "/x", {}, b"{}", idle_s=0.25)
            got = b""
            while piece := await resp.piece():
                got += piece
            assert got == b"ok" * 8
            resp.close()
            pool.close()

    run(main())


def test_no_server_is_a_connect_failure() -> None:
    async def main() -> None:
        async with Server(answer_each) as server:
            url = server.url
        pool = Pool(url, 1, 1.0)  # the server is gone: its port refuses
        with pytest.raises(ConnectFailed, match="ConnectionRefused"):
            await pool.request("POST", "/x", {}, b"{}")
        with pytest.raises(ConnectFailed):
            await Pool("http://no-such-host.invalid/v1", 1, 2.0).request("POST", "/x", {}, b"{}")

    run(main())


def test_a_header_with_a_line_break_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="line break"):
        Pool("http://127.0.0.1:9/v1", 1, 1.0)._head("POST", "/x", {"traceparent": "a\r\nX-Evil: 1"}, 0)


def test_tls_with_a_certificate_the_system_trusts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)

    async def main() -> None:
        async with Server(answer_each, tls=tls) as server:
            with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                await Pool(server.url, 1, 2.0).request("POST", "/x", {}, b"1")
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            pool = Pool(server.url, 1, 2.0)
            resp = await pool.request("POST", "/x", {}, b"1")
            assert await resp.read(100) == b'{"echo":1}'
            pool.close()

    assert os.path.exists(cert)
    run(main())

"""Calls to model servers: the one place where transport meets the gateway.

Everything goes through kiln.client (HTTP/1.1 on kept-alive connections):
requests through one pool per backend, health checks and tokenizer calls
through a small pool of their own per server, so they still get through when
a backend's pool is full. Every way a backend can fail is turned into a
GatewayError here, once, so nothing above this module sees a transport's
exception: refused connections (`failover`:
nothing reached the model, another backend may take it), timeouts (504),
dropped connections and oversized answers (502), and error statuses in the
three shapes vLLM, SGLang and llama.cpp use (`upstream_error`).

Each backend has its own connection pool (sized to its `max_in_flight`, so a
busy backend cannot starve the others) and its own timeouts
(catalog.Timeouts): connecting, and for streams the silence between two reads;
the router bounds the wait for a stream's headers. The pipeline bounds every
call by the request's overall deadline (one timer for the whole request), so
no path can outlive it.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson

from kiln import client
from kiln.catalog import Backend
from kiln.core import errors
from kiln.core.errors import GatewayError

_OVERFLOW = re.compile(
    r"maximum context length|context length|exceeds the available context|longer than the model's context",
    re.IGNORECASE,
)
_TOKENS_IN_MESSAGE = re.compile(r"(\d+) input tokens|input \((\d+) tokens\)|request \((\d+) tokens\)")
_ERROR_BODY_BYTES = 64 * 1024  # what is read of an error answer
FAILOVER_STATUSES = (502, 503, 504)
END_OF_STREAM = b"[DONE]"  # the payload that ends an OpenAI-shaped stream
_SIDE_CONNECTIONS = 16  # per server, beside its requests' pool (count_tokens calls a tokenizer per request)
_BROKEN = (TimeoutError, client.BrokenAnswer, OSError)  # what the client raises once connected


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = 64 * 1024 * 1024  # a JSON answer
    max_event_bytes: int = 8 * 1024 * 1024  # one SSE event


class Upstream:
    def __init__(self, limits: Limits = Limits()) -> None:
        self.limits = limits
        self._pools: dict[Backend, client.Pool] = {}  # requests: one pool per backend
        self._side: dict[str, client.Pool] = {}  # health checks, tokenizers: one small pool per server

    async def close(self) -> None:
        for pool in [*self._pools.values(), *self._side.values()]:
            pool.close()
        self._pools.clear()
        self._side.clear()

    def _pool(self, backend: Backend) -> client.Pool:
        pool = self._pools.get(backend)
        if pool is None:
            pool = self._pools[backend] = client.Pool(backend.url, backend.max_in_flight, backend.timeouts.connect_s,
                                                      headers=_with_key(backend, {"Content-Type": "application/json"}))
        return pool

    async def post(self, backend: Backend, path: str, body: bytes, *, stream: bool,
                   headers: dict[str, str] | None = None) -> client.Response:
        """POST and return once a 200's headers are in; any failure as a GatewayError.

        `headers` go with the request (trace context), beside the pool's content type and key.
        The caller bounds the whole exchange; a stream's every wait for bytes is bounded by the
        backend's idle timeout.
        """
        try:
            resp = await self._pool(backend).request("POST", path, headers, body,
                                                     backend.timeouts.idle_s if stream else None)
        except client.ConnectFailed as exc:
            raise unreachable(exc) from None
        except _BROKEN as exc:
            raise _mapped(exc, "before answering") from None
        if resp.status != 200:
            try:
                raw = (await resp.read(_ERROR_BODY_BYTES))[:_ERROR_BODY_BYTES]
            except _BROKEN:
                raw = b""
            raise upstream_error(resp.status, raw)
        return resp

    async def read(self, resp: client.Response) -> bytes:
        """A JSON answer's body, at most `max_body_bytes` of it."""
        limit = self.limits.max_body_bytes
        declared = resp.content_length
        try:
            if declared is not None and declared > limit:
                raise _too_large(limit)
            raw = await resp.read(limit)
        except _BROKEN as exc:
            raise _mapped(exc, "mid-response") from None
        finally:
            resp.close()
        if len(raw) > limit:
            raise _too_large(limit)
        return raw

    def events(self, resp: client.Response) -> Events:
        """The `data:` payloads of an SSE answer, raw, one list per network read (see Events)."""
        return Events(resp, SSEParser(self.limits.max_event_bytes))

    async def post_json(self, backend: Backend, url: str, payload: object, timeout_s: float = 10.0) -> object:
        """A small side call (a tokenizer): the parsed JSON answer, or a GatewayError."""
        try:
            status, raw = await self._side_call(backend, "POST", url, orjson.dumps(payload), timeout_s,
                                                self.limits.max_body_bytes)
        except client.ConnectFailed as exc:
            raise unreachable(exc) from None
        except _BROKEN as exc:
            raise _mapped(exc, "before answering") from None
        if status != 200:
            raise upstream_error(status, raw)
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise errors.bad_gateway("The model backend returned a malformed response.") from None

    async def get_json(self, backend: Backend, url: str, timeout_s: float = 5.0) -> object:
        """A small GET (what kind of server it is): the parsed JSON answer of a 200, else None."""
        try:
            status, raw = await self._side_call(backend, "GET", url, b"", timeout_s, _ERROR_BODY_BYTES)
            return orjson.loads(raw) if status == 200 else None
        except (client.ConnectFailed, *_BROKEN, orjson.JSONDecodeError):
            return None

    async def probe(self, backend: Backend, timeout_s: float = 5.0) -> tuple[str | None, bool]:
        """Health check: GET /health, or /v1/models on a server without /health (404).

        (None, _) when it answers 2xx; else what went wrong and whether the
        server could not be reached at all. vLLM's /health fails when its
        engine is dead while /v1/models still answers, so only a 404 falls back.
        """
        status = 0
        for url in (backend.url.removesuffix("/v1") + "/health", backend.url + "/models"):
            try:
                status, _ = await self._side_call(backend, "GET", url, b"", timeout_s, _ERROR_BODY_BYTES)
            except client.ConnectFailed as exc:
                return f"unreachable: {exc}", True
            except TimeoutError:
                return f"no answer within {timeout_s:g} s", False
            except (client.BrokenAnswer, OSError) as exc:
                return f"{type(exc).__name__}: {exc}", False
            if status < 300:
                return None, False
            if status not in (404, 405):
                break
        return f"HTTP {status}", False

    async def _side_call(self, backend: Backend, method: str, url: str, body: bytes, timeout_s: float,
                         limit: int) -> tuple[int, bytes]:
        """An answer's status and body (its first `limit` bytes), all within `timeout_s`."""
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        pool = self._side.get(origin)
        if pool is None:
            pool = self._side[origin] = client.Pool(origin, _SIDE_CONNECTIONS, backend.timeouts.connect_s)
        headers = _with_key(backend, {"Content-Type": "application/json"} if body else {})
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        async with asyncio.timeout(timeout_s):
            resp = await pool.request(method, path, headers, body)
            return resp.status, (await resp.read(limit))[:limit]


class Events:
    """An SSE answer's `data:` payloads, raw, one list per network read: `async for batch in ...`.

    Batching by read lets the caller answer with one write for everything that arrived
    together. Comments and other fields are skipped; the terminating `[DONE]` is yielded like
    any payload. If the backend drops the connection, the events it sent before are still
    yielded, then the 502. Parsing is linear in the bytes received however they are split,
    and one event longer than `max_event_bytes` ends the stream (502).

    A class, not an async generator: a caller stops reading at `[DONE]`, and an async
    generator left unfinished is closed by the event loop's finalizer hook, which schedules
    `aclose()` through call_soon_threadsafe (an eventfd write and read, and a task) per stream.
    """

    __slots__ = ("resp", "parser", "ended")

    def __init__(self, resp: client.Response, parser: SSEParser) -> None:
        self.resp = resp
        self.parser = parser
        self.ended = False

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> list[bytes]:
        while not self.ended:
            try:
                piece = await self.resp.piece()
            except _BROKEN as exc:
                self.ended = True
                raise _mapped(exc, "mid-stream") from None
            if not piece:
                self.ended = True
                piece = b"\n\n"  # ends an event the backend did not end with a blank line
            events = self.parser.feed(piece)
            if events:
                return events
        raise StopAsyncIteration


class SSEParser:
    """SSE bytes in, complete events' `data:` payloads out; linear in the bytes fed.

    Only the new bytes are searched for the end of an event, so a single
    event split over many reads costs no more than reading it.
    """

    def __init__(self, max_event_bytes: int) -> None:
        self.max_event_bytes = max_event_bytes
        self._buf = bytearray()

    def feed(self, piece: bytes) -> list[bytes]:
        buf = self._buf
        if buf:
            scan = max(len(buf) - 3, 0)  # an event end may straddle the old bytes and the new
            buf += piece
            # find() rather than `in` on bytes here: `x in data` first tries x as an integer, raising and
            # clearing a TypeError each time (about 2,000 instructions, more than the search)
            if buf.find(b"\n\n", scan) < 0 and (piece.find(b"\r") < 0 or buf.find(b"\r\n\r\n", scan) < 0):
                self._bound(len(buf))
                return []
            data = bytes(buf)
            self._buf = bytearray()
        else:
            data = piece
        end = data.rfind(b"\n\n") + 2  # the events that are complete; the rest waits for its end
        if end == len(data) and data.find(b"\n") == end - 2 and data[:6] == b"data: " and data[6:7] != b" " \
                and end <= self.max_event_bytes and data.find(b"\r") < 0:
            return [data[6:-2]]  # one event of one line, the read of a paced stream: no split, no join
        whole = data if end == len(data) else data[:end]
        if end > 1 and whole[:6] == b"data: " and len(whole) <= self.max_event_bytes and whole.find(b"\r") < 0:
            # The common read: whole events of one `data: ` line each (a backend flushes each
            # event as it is made; a large read ends mid-event). One split; no newline left in
            # what it gave proves every event is one line (a one-byte search, memchr, where a
            # count of the read's newlines was a slower pass), and a payload that starts with
            # more spaces is stripped of them all (the general path).
            events = whole[6:-2].split(b"\n\ndata: ")
            if b"".join(events).find(b"\n") < 0 and not _spaced(events):
                if end < len(data):
                    self._buf = bytearray(data[end:])
                    self._bound(len(self._buf))
                return events
        return self._events(data)

    def _events(self, text: bytes) -> list[bytes]:
        """Every complete event of `text`, one at a time (comments, other fields, CRLF); the rest kept."""
        if b"\r" in text:
            text = text.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        start = 0
        while True:
            end = text.find(b"\n\n", start)
            if end < 0:
                break
            self._bound(end - start)
            for line in text[start:end].split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].lstrip(b" "))
            start = end + 2
        self._buf = bytearray(text[start:])
        self._bound(len(self._buf))
        return out

    def _bound(self, size: int) -> None:
        if size > self.max_event_bytes:
            raise errors.bad_gateway(f"The model backend sent an event larger than {self.max_event_bytes} bytes.")


def _spaced(payloads: list[bytes]) -> bool:
    """Whether a payload starts with a space (its line had more than the one after `data:`).
    A look at each payload's first byte: cheaper than a search of the read for `data:  `."""
    for payload in payloads:
        if payload[:1] == b" ":
            return True
    return False


def _with_key(backend: Backend, headers: dict[str, str]) -> dict[str, str]:
    """`headers` and the backend's API key, if it has one."""
    if backend.api_key:
        headers["Authorization"] = f"Bearer {backend.api_key}"
    return headers


def unreachable(exc: BaseException) -> GatewayError:
    """Nothing reached the model: another backend may be tried."""
    err = errors.bad_gateway(f"The model backend is unreachable ({type(exc).__name__}).")
    err.failover = err.backend = True
    err.outcome = "connect"
    return err


def _mapped(exc: BaseException, when: str) -> GatewayError:
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        err = errors.timeout(f"The model backend did not answer in time ({when}).")
        err.outcome = "timeout"
    else:
        err = errors.bad_gateway(f"The model backend closed the connection {when}.")
        err.outcome = "error"
    err.backend = True
    err.failover = when == "before answering"  # nothing reached the client: another backend may take it
    return err


def _too_large(limit: int) -> GatewayError:
    err = errors.bad_gateway(f"The model backend's answer is larger than {limit} bytes.")
    err.backend, err.outcome = True, "error"
    return err


def upstream_error(status: int, body: bytes) -> GatewayError:
    """Normalise a model server's error response.

    4xx that the client caused (bad parameters, context overflow) become a
    400 carrying the server's message; 429/503 mean the backend is busy;
    everything else is the gateway's or the backend's fault and becomes a
    502 with a plain-text body, per the contract.
    """
    message, param = _message(body)
    if status in (400, 413, 422):
        err = errors.invalid(message or "The model server rejected the request.", param=param)
        if _OVERFLOW.search(message or ""):
            err.code = "context_length_exceeded"
    elif status in (429, 503):
        err = errors.unavailable(f"The model backend is overloaded (HTTP {status}); retry with exponential backoff.")
    else:
        err = errors.bad_gateway(f"The model backend returned an error (HTTP {status}).")
    err.backend = True
    err.outcome = "error" if status >= 500 else ""
    err.failover = status in FAILOVER_STATUSES  # the backend could not take it: another one may
    return err


def in_stream_error(payload: dict[str, object]) -> GatewayError:
    """An error object a backend sent inside an SSE stream after its 200."""
    raw = payload.get("error")
    message = raw.get("message") if isinstance(raw, dict) else raw
    code = raw.get("code") if isinstance(raw, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 500
    return upstream_error(status, orjson.dumps({"error": {"message": str(message or "")}}))


def overflow_tokens(message: str) -> int | None:
    m = _TOKENS_IN_MESSAGE.search(message)
    return int(next(g for g in m.groups() if g)) if m else None


def _message(body: bytes) -> tuple[str, str | None]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode("utf-8", "replace").strip()
        return text[:2000], None
    if isinstance(data, dict):
        err = data.get("error", data)  # vLLM/llama.cpp wrap it; SGLang is flat
        if isinstance(err, dict):
            param = err.get("param")
            return str(err.get("message") or err.get("detail") or "")[:2000], param if isinstance(param, str) else None
        if isinstance(err, str):
            return err[:2000], None
    return "", None

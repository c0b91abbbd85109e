"""The pooled HTTP client to model servers, and what their errors mean.

aiohttp with keep-alive connection pools (one per backend): the measured
difference to httpx on this path is an order of magnitude. Errors from
vLLM, SGLang and llama.cpp come in three shapes; `upstream_error` turns any
of them into one GatewayError the client's protocol can render.
"""

from __future__ import annotations

import re
from typing import AsyncIterator

import aiohttp
import orjson

from kiln.catalog import Backend
from kiln.core import errors
from kiln.core.errors import GatewayError

_OVERFLOW = re.compile(
    r"maximum context length|context length|exceeds the available context|longer than the model's context",
    re.IGNORECASE,
)
_TOKENS_IN_MESSAGE = re.compile(r"(\d+) input tokens|input \((\d+) tokens\)|request \((\d+) tokens\)")


class Upstream:
    """One connection pool per backend, sized to its max_in_flight, so a busy backend cannot
    starve the others of connections; and one small pool for health checks and /tokenize,
    so those still get through when a backend's pool is full."""

    def __init__(self) -> None:
        self.session: aiohttp.ClientSession | None = None  # health checks, /tokenize
        self._pools: dict[Backend, aiohttp.ClientSession] = {}

    async def start(self) -> None:
        self.session = _session(aiohttp.TCPConnector(limit=64, keepalive_timeout=60, ttl_dns_cache=300))

    async def close(self) -> None:
        sessions = [self.session, *self._pools.values()] if self.session else list(self._pools.values())
        self.session = None
        self._pools.clear()
        for session in sessions:
            await session.close()

    def _pool(self, backend: Backend) -> aiohttp.ClientSession:
        pool = self._pools.get(backend)
        if pool is None:
            connector = aiohttp.TCPConnector(limit=backend.max_in_flight, keepalive_timeout=60, ttl_dns_cache=300)
            pool = self._pools[backend] = _session(connector)
        return pool

    async def post(self, backend: Backend, path: str, body: bytes, stream: bool = False) -> aiohttp.ClientResponse:
        """Send a request and return once the status and headers are in.

        The connect timeout is the backend's; a stream also gets its idle
        timeout between reads (a non-streaming answer is silent until done).
        Failures raise aiohttp.ClientError or TimeoutError; the router decides
        whether to try another backend.
        """
        headers = {"Content-Type": "application/json"}
        if backend.api_key:
            headers["Authorization"] = f"Bearer {backend.api_key}"
        t = backend.timeouts
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.connect_s, sock_read=t.idle_s if stream else None)
        return await self._pool(backend).post(backend.url + path, data=body, headers=headers, timeout=timeout)

    async def probe(self, backend: Backend, timeout_s: float = 5.0) -> tuple[str | None, bool]:
        """Health check: GET /health, or /v1/models on a server without /health (404).

        (None, _) when it answers 2xx; else what went wrong and whether the
        server could not be reached at all. vLLM's /health fails when its
        engine is dead while /v1/models still answers, so only a 404 falls back.
        """
        assert self.session is not None
        headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else None
        status = 0
        for url in (backend.url.removesuffix("/v1") + "/health", backend.url + "/models"):
            try:
                async with self.session.get(
                    url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
                ) as resp:
                    await resp.read()
                    status = resp.status
            except aiohttp.ClientConnectorError as exc:
                return f"unreachable: {exc.os_error or exc}", True
            except TimeoutError:
                return f"no answer within {timeout_s:g} s", False
            except aiohttp.ClientError as exc:
                return type(exc).__name__, False
            if status < 300:
                return None, False
            if status not in (404, 405):
                break
        return f"HTTP {status}", False

    async def post_json(self, backend: Backend, url: str, payload: object, timeout_s: float = 10.0) -> object:
        assert self.session is not None
        headers = {"Authorization": f"Bearer {backend.api_key}"} if backend.api_key else None
        async with self.session.post(
            url, data=orjson.dumps(payload), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            resp.raise_for_status()
            return await resp.json(loads=orjson.loads, content_type=None)


def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        json_serialize=lambda o: orjson.dumps(o).decode(),
        auto_decompress=True,
        skip_auto_headers=("User-Agent",),
    )


async def sse_batches(resp: aiohttp.ClientResponse) -> AsyncIterator[list[bytes]]:
    """The `data:` payloads of an SSE response, as raw bytes, one list per network read.

    Batching by read lets the caller answer with one write for everything
    that arrived together. Comments and other fields are skipped; the
    terminating `[DONE]` is yielded like any payload. If the backend drops the
    connection, the events it sent before are still yielded, then the error
    is raised.
    """
    buf = b""
    try:
        async for piece in resp.content.iter_any():
            events, buf = _split_events(buf + piece)
            if events:
                yield events
    except aiohttp.ServerTimeoutError as exc:  # the backend's idle timeout between reads
        raise errors.timeout("The model backend stopped sending (idle timeout).") from exc
    except aiohttp.ClientPayloadError:
        # aiohttp raises before handing out what it had buffered; take it first.
        pending = getattr(resp.content, "_buffer", ())
        events, _ = _split_events(buf + b"".join(pending))
        if events:
            yield events
        raise
    events, _ = _split_events(buf + b"\n\n")
    if events:
        yield events


def _split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events' data payloads in buf, and the incomplete rest."""
    if b"\r" in buf:
        buf = buf.replace(b"\r\n", b"\n")
    out: list[bytes] = []
    start = 0
    while True:
        end = buf.find(b"\n\n", start)
        if end < 0:
            break
        for line in buf[start:end].split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].lstrip(b" "))
        start = end + 2
    return out, buf[start:]


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
        return err
    if status in (429, 503):
        return errors.unavailable("The model backend is overloaded; retry with exponential backoff.")
    return errors.bad_gateway(f"The model backend returned an error (HTTP {status}).")


def in_stream_error(payload: dict[str, object]) -> GatewayError:
    """An error object a backend sent inside an SSE stream after its 200."""
    raw = payload.get("error")
    message = raw.get("message") if isinstance(raw, dict) else raw
    code = raw.get("code") if isinstance(raw, dict) else None
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
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
            return str(err.get("message") or err.get("detail") or ""), param if isinstance(param, str) else None
        if isinstance(err, str):
            return err, None
    return "", None

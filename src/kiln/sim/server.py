"""The aiohttp application: routes, auth, fault injection, stats and streaming.

Hot path (zero delays, no faults): parse with orjson, render + tokenize the prompt,
take a cached deterministic reply, serialise once, one write. No per-chunk logging.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from . import checks, tokenizer, wire
from .checks import Invalid
from .settings import SimSettings

Handler = Callable[[web.Request, "Ctx"], Awaitable[web.StreamResponse]]
BLOCK = 16  # prefix-cache block size, in tokens
PREFIX_CACHE_BLOCKS = 10_000
RECENT_REQUESTS = 100
_POLL_S = 0.05


class Ctx:
    """Per-request outcome flags the tracking wrapper reads after the handler."""

    __slots__ = ("faulted",)

    def __init__(self) -> None:
        self.faulted = False


class Stats:
    """Counters for /sim/stats."""

    __slots__ = ("in_flight", "max_in_flight", "total", "completed", "cancelled", "errors",
                 "prompt_tokens", "cached_tokens", "peers")

    def __init__(self) -> None:
        self.in_flight = self.max_in_flight = self.total = 0
        self.completed = self.cancelled = self.errors = 0
        self.prompt_tokens = self.cached_tokens = 0  # over generation requests: the prefix-cache hit ratio
        self.peers: set[Any] = set()  # the client connections (address, port) /v1 calls came on

    def to_dict(self) -> dict[str, int]:
        out = {k: getattr(self, k) for k in self.__slots__ if k != "peers"}
        out["connections"] = len(self.peers)  # how well a client reuses its connections
        return out

    def reset(self) -> None:
        self.max_in_flight = self.in_flight
        self.total = self.completed = self.cancelled = self.errors = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.peers = set()


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _ms(value: Any, default: float) -> float:
    """A sim delay override in ms -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return value / 1000.0
    return default / 1000.0


async def _sleep(request: web.Request, seconds: float, poll: float = _POLL_S) -> None:
    """Sleep, but notice a client disconnect even without handler cancellation (every `poll` s)."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(left, poll))
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client went away")


def _close(request: web.Request) -> None:
    """Drop the connection (FIN after flushing what was already written)."""
    transport = request.transport
    if transport is not None:
        transport.close()


class SimServer:
    """Holds the mutable state (settings, stats, caches) behind the routes."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.stats = Stats()
        # (path, parsed body, raw header pairs); headers are decoded only when listed
        self.recent: deque[tuple[str, Any, tuple[tuple[bytes, bytes], ...]]] = deque(maxlen=RECENT_REQUESTS)
        self.prefix: OrderedDict[int, None] = OrderedDict()
        self.started = int(time.time())

    # ----------------------------------------------------------------- plumbing

    def track(self, handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """Wrap a /v1 handler with in-flight / completed / cancelled / error accounting."""
        stats = self.stats

        async def wrapped(request: web.Request) -> web.StreamResponse:
            stats.total += 1
            if request.transport is not None:
                stats.peers.add(request.transport.get_extra_info("peername"))
            stats.in_flight += 1
            if stats.in_flight > stats.max_in_flight:
                stats.max_in_flight = stats.in_flight
            ctx = Ctx()
            try:
                resp = await handler(request, ctx)
            except asyncio.CancelledError:
                if ctx.faulted:
                    stats.errors += 1
                else:
                    stats.cancelled += 1
                raise
            except ConnectionError:
                if ctx.faulted:
                    stats.errors += 1
                else:
                    stats.cancelled += 1
                return web.Response(status=499)
            finally:
                stats.in_flight -= 1
            if ctx.faulted or resp.status >= 400:
                stats.errors += 1
            else:
                stats.completed += 1
            return resp

        return wrapped

    async def read_body(self, request: web.Request, record: bool = True) -> dict[str, Any] | web.Response:
        """Read (and for /v1 record) the JSON body, enforce the API key; a Response means stop."""
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            if record:
                self.recent.append((request.path, raw.decode("utf-8", "replace"), request.raw_headers))
            return self.auth(request) or self.invalid(checks.invalid_json(str(exc)))
        if record:
            self.recent.append((request.path, body, request.raw_headers))
        denied = self.auth(request)
        if denied is not None:
            return denied
        if not isinstance(body, dict):
            return self.invalid(checks.schema_error("model_attributes_type", "", "Input should be a valid dictionary", body))
        return body

    def auth(self, request: web.Request) -> web.Response | None:
        """vLLM's --api-key middleware answer."""
        key = self.settings.api_key
        if key and request.headers.get("Authorization") != "Bearer " + key:
            return web.Response(status=401, body=b'{"error":"Unauthorized"}', content_type=wire.JSON_CT)
        return None

    @staticmethod
    def invalid(bad: Invalid) -> web.Response:
        return wire.error_response(bad.status, bad.message, bad.etype, bad.param)

    def check_model(self, body: dict[str, Any]) -> str | web.Response:
        """Resolve the served model name (missing -> first model, like vLLM)."""
        model = body.get("model")
        models = self.settings.models
        if model is None:
            return models[0] if models else "default"
        if model not in models:
            return wire.error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return model

    def cached_tokens(self, model: str, ids: list[int]) -> int:
        """Longest previously seen prefix, in whole 16-token blocks (LRU-bounded, per model).

        Like vLLM, the last prompt token is always recomputed, so a fully repeated
        prompt reports the largest block multiple strictly below its length.
        """
        n_blocks = len(ids) // BLOCK
        if not n_blocks:
            return 0
        lookup = (len(ids) - 1) // BLOCK
        cache = self.prefix
        h = hash(model)
        hit = 0
        matching = True
        for b in range(n_blocks):
            h = hash((h, *ids[b * BLOCK : (b + 1) * BLOCK]))
            if matching:
                if b < lookup and h in cache:
                    hit += 1
                else:
                    matching = False
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > PREFIX_CACHE_BLOCKS:
            cache.popitem(last=False)
        return hit * BLOCK

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Count a request's prompt in the stats; the simulated prefill time of its uncached part."""
        self.stats.prompt_tokens += prompt_tokens
        self.stats.cached_tokens += cached_tokens
        return (prompt_tokens - cached_tokens) * self.settings.prefill_us_per_token / 1e6

    async def pre_faults(self, request: web.Request, sim: dict[str, Any], ctx: Ctx) -> web.StreamResponse | None:
        """sim.delay_ms, sim.status and sim.malformed, applied before validation."""
        delay = _ms(sim.get("delay_ms"), 0.0)
        if delay > 0:
            await _sleep(request, delay)
        if sim.get("malformed") is True:  # a 200 whose body is not what a model server sends
            if sim.get("stream_malformed") is True:
                return web.Response(body=b"data: {not json\n\n", content_type="text/event-stream")
            return web.Response(body=b"<html>not json</html>", content_type=wire.JSON_CT)
        status = _int(sim.get("status"))
        if status is not None and status >= 400:
            message = sim.get("error_message")
            if status == 500 and not isinstance(message, str):
                return wire.plain_500()
            if not isinstance(message, str):
                message = f"Simulated error {status}"
            return wire.error_response(status, message)
        return None

    @staticmethod
    def extra_headers(resp: web.StreamResponse, sim: dict[str, Any]) -> web.StreamResponse:
        """sim.headers: extra response headers (e.g. Retry-After on a 429)."""
        headers = sim.get("headers")
        if isinstance(headers, dict) and not resp.prepared:
            for k, v in headers.items():
                resp.headers[str(k)] = str(v)
        return resp

    async def finish_plain(
        self, request: web.Request, sim: dict[str, Any], ctx: Ctx, body: bytes, n_tokens: int, prefill_s: float = 0.0
    ) -> web.StreamResponse:
        """Non-streaming answer: wait out the simulated generation time, then one body."""
        s = self.settings
        wait = prefill_s + _ms(sim.get("ttft_ms"), s.ttft_ms) + _ms(sim.get("token_delay_ms"), s.token_delay_ms) * max(n_tokens - 1, 0)
        if wait > 0:
            await _sleep(request, wait)
        if _int(sim.get("drop_after")) is not None:
            ctx.faulted = True
            _close(request)
            return web.Response(status=200)
        if _int(sim.get("error_after")) is not None:
            return wire.error_response(500, str(sim.get("error_message") or "Simulated failure during generation"))
        return self.extra_headers(web.Response(body=body, content_type=wire.JSON_CT), sim)

    async def stream(
        self,
        request: web.Request,
        sim: dict[str, Any],
        ctx: Ctx,
        events: list[bytes],
        delay_from: int,
        delay_to: int,
        prefill_s: float = 0.0,
    ) -> web.StreamResponse:
        """Send SSE events: prefill + ttft before the first, token delay before events[delay_from:delay_to].

        Faults: sim.drop_after N closes the connection after N events; sim.error_after N
        sends N events, an in-band error and [DONE]. With no delays and no faults all
        events go out in a single write.
        """
        s = self.settings
        resp = self.extra_headers(web.StreamResponse(status=200, headers=wire.SSE_HEADERS), sim)
        await resp.prepare(request)
        drop = _int(sim.get("drop_after"))
        fail = _int(sim.get("error_after"))
        after = drop if drop is not None else fail
        if after is not None:
            ctx.faulted = True
            events = events[: min(after, len(events) - 1)]  # never the final [DONE]
            if drop is None:
                msg = str(sim.get("error_message") or "Simulated failure during generation")
                events += [wire.stream_error_event(msg), wire.DONE]
        ttft = prefill_s + _ms(sim.get("ttft_ms"), s.ttft_ms)
        gap = _ms(sim.get("token_delay_ms"), s.token_delay_ms)
        poll = _ms(sim.get("poll_ms"), _POLL_S * 1000)  # thousands of slow streams: poll less often
        if ttft <= 0 and gap <= 0:
            await resp.write(b"".join(events))
        else:
            for i, event in enumerate(events):
                if i == 0:
                    if ttft > 0:
                        await _sleep(request, ttft, poll)
                elif gap > 0 and delay_from <= i < delay_to:
                    await _sleep(request, gap, poll)
                await resp.write(event)
        if drop is not None:
            _close(request)
            return resp
        await resp.write_eof()
        return resp

    # ----------------------------------------------------------------- small routes

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's GET /version (how a gateway can tell what kind of server it is)."""
        return wire.json_response({"version": "0.33.0+kiln.sim"})

    async def models(self, request: web.Request) -> web.Response:
        denied = self.auth(request)
        if denied is not None:
            return denied
        s = self.settings
        data = [
            {
                "id": m,
                "object": "model",
                "created": self.started,
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": s.max_model_len,
            }
            for m in s.models
        ]
        return wire.json_response({"object": "list", "data": data})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request, record=False)
        if isinstance(body, web.Response):
            return body
        if body.get("model") is not None:
            model = self.check_model(body)
            if isinstance(model, web.Response):
                return model
        try:
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list):
                    return self.invalid(checks.schema_error("list_type", "messages", "Input should be a valid list"))
                text = tokenizer.render_chat(
                    messages, body.get("tools"), body.get("add_generation_prompt", True) is not False
                )
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                return self.invalid(checks.schema_error("missing", "prompt", "Field required"))
        except ValueError as exc:
            return self.invalid(Invalid(str(exc)))
        pieces = tokenizer.split(text)
        return wire.json_response(
            {
                "count": len(pieces),
                "max_model_len": self.settings.max_model_len,
                "tokens": tokenizer.ids_of(pieces),
                "token_strs": pieces if body.get("return_token_strs") is True else None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self.read_body(request, record=False)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return self.invalid(checks.schema_error("list_type", "tokens", "Input should be a valid list of integers"))
        return wire.json_response({"prompt": tokenizer.decode(tokens)})

    async def get_stats(self, request: web.Request) -> web.Response:
        return wire.json_response({"id": self.settings.id, **self.stats.to_dict()})

    async def reset_stats(self, request: web.Request) -> web.Response:
        self.stats.reset()
        return await self.get_stats(request)

    async def get_requests(self, request: web.Request) -> web.Response:
        out = [
            {"path": path, "body": body, "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}}
            for path, body, raw in self.recent
        ]
        return wire.json_response(out)

    async def clear_requests(self, request: web.Request) -> web.Response:
        self.recent.clear()
        return wire.json_response([])

    async def get_config(self, request: web.Request) -> web.Response:
        return wire.json_response(self.settings.to_dict())

    async def set_config(self, request: web.Request) -> web.Response:
        try:
            patch = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError as exc:
            return self.invalid(checks.invalid_json(str(exc)))
        if not isinstance(patch, dict):
            return wire.error_response(400, "expected a JSON object of settings")
        try:
            self.settings.merge(patch)
        except ValueError as exc:
            return wire.error_response(400, str(exc))
        return wire.json_response(self.settings.to_dict())

    async def add_rule(self, request: web.Request) -> web.Response:
        try:
            self.settings.add_rule(orjson.loads(await request.read() or b"{}"))
        except (orjson.JSONDecodeError, ValueError) as exc:
            return wire.error_response(400, str(exc))
        return wire.json_response({"rules": len(self.settings.rules)})


def new_id(prefix: str) -> str:
    """vLLM-style random request id."""
    return prefix + os.urandom(16).hex()

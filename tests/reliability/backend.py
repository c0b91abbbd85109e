"""A deliberately broken OpenAI-compatible model server, beside the simulator.

The fault comes from the request itself: the first `fault=NAME` in the raw body
(it is in the prompt, so it reaches this server from every client protocol:
chat, completions, responses, messages). Without one, a well-behaved answer.

    ok               a normal answer: REPLY_TOKENS tokens, exact usage
    hang_headers     read the request, then send nothing (not even headers)
    slow_first_byte  wait SLOW_S, then answer normally
    headers_silence  200 and the SSE headers (or JSON headers), then nothing
    trickle          the normal answer, one byte every TRICKLE_S
    http_500         HTTP 500 with a vLLM error body
    drop_mid         stream: DELIVERED token chunks, then close the TCP connection;
                     JSON: headers, half a body, close
    garbage_mid      stream: DELIVERED token chunks, then a data line that is not JSON
    huge_line        stream: one SSE line of HUGE_BYTES, no newline until its end
    huge_json        JSON: a valid body of HUGE_BYTES (one long content string)
    big_json         JSON: a valid body of BIG_BYTES, far more than one network read
    negative_usage   a normal answer whose usage says -1,000,000 prompt and completion tokens
    absurd_usage     a normal answer whose usage says 10^19 completion tokens (> 2^63 nanodollars)
    multi            every output the request allows, each to its max_tokens: n per prompt (chat: n),
                     the worst a multi-output request can cost

Hanging faults hang at most HANG_S, so a gateway that never times out still
lets the suite finish (and the test measures how long it really took).

    python tests/reliability/backend.py --port 0     prints "listening on http://127.0.0.1:PORT"
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from typing import Any

import orjson
from aiohttp import web

REPLY_TOKENS = 12
DELIVERED = 5  # token chunks before a mid-stream fault
PROMPT_TOKENS = 20
SLOW_S = 2.0
HANG_S = 8.0
TRICKLE_S = 0.001
HUGE_BYTES = 32 * 1024 * 1024
BIG_BYTES = 4 * 1024 * 1024  # under the suite's gateway's limit (MAX_BODY_BYTES in conftest)
_FAULT = re.compile(rb"fault=([a-z_0-9]+)")


def fault_of(raw: bytes) -> str:
    m = _FAULT.search(raw)
    return m.group(1).decode() if m else "ok"


def _usage(fault: str, completion: int) -> dict[str, int]:
    if fault == "negative_usage":
        return {"prompt_tokens": -1_000_000, "completion_tokens": -1_000_000, "total_tokens": -2_000_000}
    if fault == "absurd_usage":
        big = 10**19
        return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": big, "total_tokens": big + PROMPT_TOKENS}
    return {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": completion,
            "total_tokens": PROMPT_TOKENS + completion}


def _chunk(chat: bool, model: str, piece: dict[str, Any] | None, finish: str | None = None,
           usage: dict[str, int] | None = None) -> bytes:
    if chat:
        choices = [] if piece is None and finish is None else [
            {"index": 0, "delta": piece or {}, "logprobs": None, "finish_reason": finish}]
        obj: dict[str, Any] = {"id": "chatcmpl-adv", "object": "chat.completion.chunk", "created": int(time.time()),
                               "model": model, "choices": choices}
    else:
        choices = [] if piece is None and finish is None else [
            {"index": 0, "text": (piece or {}).get("content", ""), "logprobs": None, "finish_reason": finish}]
        obj = {"id": "cmpl-adv", "object": "text_completion", "created": int(time.time()), "model": model,
               "choices": choices}
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def stream_events(chat: bool, model: str, fault: str, tokens: int, continuous: bool) -> list[bytes]:
    """Role chunk (chat), token chunks, finish chunk, usage chunk, [DONE]."""
    running = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 0, "total_tokens": PROMPT_TOKENS}
    events = [_chunk(chat, model, {"role": "assistant", "content": ""}, usage=dict(running) if continuous else None)]
    if not chat:
        events = []
    for i in range(tokens):
        running = {**running, "completion_tokens": i + 1, "total_tokens": PROMPT_TOKENS + i + 1}
        events.append(_chunk(chat, model, {"content": f"tok{i} "}, usage=dict(running) if continuous else None))
    events.append(_chunk(chat, model, {}, finish="stop", usage=dict(running) if continuous else None))
    events.append(_chunk(chat, model, None, usage=_usage(fault, tokens)))
    events.append(b"data: [DONE]\n\n")
    return events


def json_body(chat: bool, model: str, fault: str, tokens: int) -> bytes:
    text = "".join(f"tok{i} " for i in range(tokens))
    if fault == "huge_json":
        text = "x" * HUGE_BYTES
    elif fault == "big_json":
        text = "y" * BIG_BYTES
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": "stop"}
        obj: dict[str, Any] = {"id": "chatcmpl-adv", "object": "chat.completion", "created": int(time.time()),
                               "model": model, "choices": [choice]}
    else:
        obj = {"id": "cmpl-adv", "object": "text_completion", "created": int(time.time()), "model": model,
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}]}
    obj["usage"] = _usage(fault, tokens)
    return orjson.dumps(obj)


async def _hang(request: web.Request) -> None:
    """Sleep up to HANG_S, or until the gateway gives up on us."""
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        await asyncio.sleep(0.05)


def _close(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.abort()


async def generate(request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    body = orjson.loads(raw)
    fault = fault_of(raw)
    request.app["log"].append({"path": request.path, "fault": fault, "stream": bool(body.get("stream"))})
    chat = request.path.endswith("/chat/completions")
    model = body.get("model", "adv")
    stream = bool(body.get("stream"))
    continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
    if fault == "hang_headers":
        await _hang(request)
        raise web.HTTPServiceUnavailable(text="hung")
    if fault == "slow_first_byte":
        await asyncio.sleep(SLOW_S)
    if fault == "http_500":
        return web.json_response({"object": "error", "message": "boom", "type": "InternalServerError",
                                  "param": None, "code": 500}, status=500)
    if fault == "multi":
        return await _multi(request, body, chat, model, stream)
    resp = web.StreamResponse(status=200)
    resp.content_type = "text/event-stream" if stream else "application/json"
    if fault == "huge_json" or not stream:
        payload = json_body(chat, model, fault, REPLY_TOKENS)
        if fault == "drop_mid":
            resp.content_length = len(payload)
    await resp.prepare(request)
    if fault == "headers_silence":
        await _hang(request)
        return resp
    if not stream:
        if fault == "drop_mid":
            await resp.write(payload[: len(payload) // 2])
            _close(request)
            return resp
        await _send(request, resp, [payload], fault)
        return resp
    if fault == "huge_line":
        await resp.write(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"")
        block = b"x" * (1 << 20)
        for _ in range(HUGE_BYTES // len(block)):
            await resp.write(block)
        await resp.write(b"\"}}]}\n\n")
        return resp
    events = stream_events(chat, model, fault, REPLY_TOKENS, continuous)
    if fault in ("drop_mid", "garbage_mid"):
        events = events[: DELIVERED + (1 if chat else 0)]
        await _send(request, resp, events, fault)
        if fault == "drop_mid":
            await asyncio.sleep(0.05)
            _close(request)
        else:
            await resp.write(b"data: {this is not json\n\n")
            await _hang(request)
        return resp
    await _send(request, resp, events, fault)
    return resp


async def _multi(request: web.Request, body: dict[str, Any], chat: bool, model: str,
                 stream: bool) -> web.StreamResponse:
    prompts = body.get("prompt") if isinstance(body.get("prompt"), list) else [None]
    outputs = int(body.get("n") or 1) * len(prompts)
    tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    usage = {"prompt_tokens": PROMPT_TOKENS * len(prompts), "completion_tokens": outputs * tokens,
             "total_tokens": PROMPT_TOKENS * len(prompts) + outputs * tokens}
    if not stream:
        text = "t " * tokens
        choices = [{"index": i, "finish_reason": "length", "logprobs": None,
                    **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
                   for i in range(outputs)]
        obj = {"id": "adv-multi", "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": model, "choices": choices, "usage": usage}
        return web.Response(body=orjson.dumps(obj), content_type="application/json")
    resp = web.StreamResponse(status=200)
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        obj = {"id": "adv-multi", "object": kind, "created": 0, "model": model, "choices": choices, **(extra or {})}
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    try:
        if chat:
            await resp.write(b"".join(event([{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]) for i in range(outputs)))
        for _ in range(tokens):
            piece = [{"index": i, **({"delta": {"content": "t "}} if chat else {"text": "t "}), "finish_reason": None}
                     for i in range(outputs)]
            await resp.write(b"".join(event([c]) for c in piece))
            await asyncio.sleep(0.001)
        await resp.write(b"".join(event([{"index": i, **({"delta": {}} if chat else {"text": ""}),
                                          "finish_reason": "length"}]) for i in range(outputs)))
        await resp.write(event([], {"usage": usage}) + b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the gateway cut the stream (the money ran out)
    return resp


async def _send(request: web.Request, resp: web.StreamResponse, events: list[bytes], fault: str) -> None:
    for event in events:
        if fault == "trickle":
            for i in range(len(event)):
                await resp.write(event[i:i + 1])
                await asyncio.sleep(TRICKLE_S)
        else:
            await resp.write(event)
    await resp.write_eof()


async def tokenize(request: web.Request) -> web.Response:
    return web.json_response({"count": PROMPT_TOKENS, "max_model_len": 32768, "tokens": []})


async def requests_log(request: web.Request) -> web.Response:
    return web.json_response(request.app["log"])


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app() -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["log"] = []
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/adv/requests", requests_log)
    return app


async def _main(port: int) -> None:
    runner = web.AppRunner(make_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"adversarial backend listening on http://127.0.0.1:{bound}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    try:
        asyncio.run(_main(parser.parse_args(sys.argv[1:]).port))
    except KeyboardInterrupt:
        pass

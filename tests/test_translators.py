"""Each translator on recorded backend bytes, in process, beside the end-to-end tests.

The recordings (tests/recordings/) are the simulator's vLLM 0.33 wire
format: a JSON answer and its SSE stream with continuous usage stats, for a
text reply with reasoning, two tool calls, and a reply cut at max_tokens. A
translator is driven through its contract alone (request, chunk, finish,
response, render, error), the way the pipeline drives it, so these tests
pin the contract and each protocol's mapping without a server in between.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from kiln.catalog import Backend, Capabilities, Catalog, Model
from kiln.core.errors import GatewayError
from kiln.core.money import Prices
from kiln.core.records import Usage
from kiln.protocols.anthropic.count_tokens import CountTokensTranslator
from kiln.protocols.anthropic.messages import MessagesTranslator
from kiln.protocols.base import Context, Translator
from kiln.protocols.openai.chat import ChatTranslator
from kiln.protocols.openai.completions import CompletionsTranslator
from kiln.protocols.openai.responses import ResponsesTranslator
from kiln.protocols import text_runs
from kiln.protocols.reasoning import ReasoningSeal
from kiln.upstream import SSEParser

RECORDINGS = Path(__file__).with_name("recordings")
MODEL = Model("m", [Backend("http://127.0.0.1:9/v1", "backend-m")], Prices(Decimal(1), Decimal(1), Decimal(2)),
              32768, 8192, Capabilities(reasoning=True), family="qwen3", aliases=("alias-m",))
CTX = Context(Catalog([MODEL]), ReasoningSeal(b"k" * 32))
HI = [{"role": "user", "content": "hi"}]
WEATHER_ANTHROPIC = {"name": "get_weather", "description": "Weather.",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def payloads(name: str) -> list[bytes]:
    """The data payloads of a recorded stream, split as the upstream boundary splits them."""
    return SSEParser(1 << 20).feed((RECORDINGS / f"{name}.sse").read_bytes())


def run_stream(tr: Translator, name: str) -> tuple[bytes, Usage, int]:
    """Feed a recording through chunk() until the translator is done; finish with the last usage."""
    out, usage, delivered = [], None, 0
    for payload in payloads(name):
        frames, reported, pieces, done = tr.chunk(payload)
        out.append(frames)
        usage = reported or usage
        delivered += pieces
        if done:
            break
    assert usage is not None
    out.append(tr.finish(usage, 1234))
    return b"".join(out), usage, delivered


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for frame in raw.decode().split("\n\n"):
        if frame.startswith("event: "):
            head, data = frame.split("\n", 1)
            events.append((head[len("event: "):], json.loads(data[len("data: "):])))
    return events


# -- the contract itself -----------------------------------------------------------------------------


def test_request_returns_an_upstream_call_and_the_cap_is_lowered_only_through_it() -> None:
    call = ChatTranslator(CTX).request({"model": "alias-m", "messages": HI, "max_completion_tokens": 100, "n": 2})
    assert (call.model, call.path, call.stream, call.max_output_tokens, call.outputs) == (MODEL, "/chat/completions",
                                                                                         False, 100, 2)
    assert "model" not in call.body and call.prompt() == {"messages": HI}
    call.lower_cap(40)
    sent = json.loads(call.encode("backend-m"))
    assert sent["model"] == "backend-m" and sent["max_tokens"] == 40 and "max_completion_tokens" not in sent


def test_every_protocol_maps_to_an_upstream_call() -> None:
    calls = [
        CompletionsTranslator(CTX).request({"model": "m", "prompt": ["a", "b"], "n": 3, "max_tokens": 7}),
        ResponsesTranslator(CTX).request({"model": "m", "input": "hi", "stream": True, "max_output_tokens": 50}),
        MessagesTranslator(CTX).request({"model": "m", "max_tokens": 64, "messages": HI}),
        CountTokensTranslator(CTX).request({"model": "m", "messages": HI, "tools": [WEATHER_ANTHROPIC]}),
    ]
    assert [(c.path, c.stream, c.max_output_tokens, c.outputs, c.kind) for c in calls] == [
        ("/completions", False, 7, 6, "generation"), ("/chat/completions", True, 50, 1, "generation"),
        ("/chat/completions", False, 64, 1, "generation"), ("/tokenize", False, 0, 1, "count")]
    assert calls[1].body["stream_options"] == {"include_usage": True}
    assert calls[3].prompt()["tools"][0]["function"]["name"] == "get_weather"
    assert calls[3].prompt()["add_generation_prompt"] is True


def test_a_backend_answer_of_the_wrong_shape_is_a_502_not_a_defect() -> None:
    for tr in (ChatTranslator(CTX), MessagesTranslator(CTX), ResponsesTranslator(CTX)):
        body: dict[str, Any] = {"model": "m", "messages": HI, "input": "hi", "max_tokens": 8, "stream": True}
        tr.request(body)
        for bad in (b"not json", b"[1]", b'{"choices": "x"}', b'{"choices": [{"delta": []}]}',
                    b'{"choices": [{"delta": {"content": 5}}]}', b'{"choices": [{"delta": {"tool_calls": [1]}}]}'):
            if isinstance(tr, ChatTranslator) and bad.startswith(b'{"choices"'):
                continue  # pass-through: a chunk that is a JSON object is forwarded, not read
            with pytest.raises(GatewayError) as exc:
                tr.chunk(bad)
            assert exc.value.status == 502 and exc.value.backend  # the backend's fault, not a defect of Kiln


def test_an_in_stream_backend_error_is_raised_as_the_backends() -> None:
    tr = MessagesTranslator(CTX)
    tr.request({"model": "m", "max_tokens": 8, "messages": HI, "stream": True})
    with pytest.raises(GatewayError) as exc:
        tr.chunk(b'{"error": {"message": "engine died", "code": 500}}')
    assert exc.value.status == 502 and exc.value.backend


# -- Chat: nearly the identity -------------------------------------------------------------------------


def test_chat_stream_passes_bytes_through_with_the_clients_model_name() -> None:
    tr = ChatTranslator(CTX)
    tr.request({"model": "alias-m", "messages": HI, "stream": True})
    raw, usage, delivered = run_stream(tr, "chat-text")
    recorded = payloads("chat-text")
    chunks = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert all(c["model"] == "alias-m" for c in chunks)
    assert len(chunks) == len(recorded) - 2  # the usage chunk is held back (not asked for); [DONE] ends it
    assert delivered == usage.completion_tokens  # the role and finish chunks carry no output
    assert raw.endswith(b"data: [DONE]\n\n") and tr.finish_reason() == "stop"


def test_chat_json_gets_the_cost_as_an_exact_number() -> None:
    tr = ChatTranslator(CTX)
    tr.request({"model": "m", "messages": HI})
    usage = tr.response((RECORDINGS / "chat-tools.json").read_bytes())
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens) == (91, 64, 4)
    body = json.loads(tr.render(usage, 1234), parse_float=Decimal)
    assert body["usage"]["cost"] == Decimal("0.000001234") and body["model"] == "m"
    assert len(body["choices"][0]["message"]["tool_calls"]) == 2 and tr.finish_reason() == "tool_calls"


def test_chat_usage_the_backend_cannot_have_used_is_not_trusted() -> None:
    tr = ChatTranslator(CTX)
    tr.request({"model": "m", "messages": HI})
    for usage in ({"prompt_tokens": -5, "completion_tokens": 3}, {"prompt_tokens": 1 << 62, "completion_tokens": 1},
                  {"prompt_tokens": "9", "completion_tokens": 1}, {"prompt_tokens": True, "completion_tokens": 1}):
        raw = json.dumps({"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}], "usage": usage})
        assert tr.response(raw.encode()) is None


# -- Messages ----------------------------------------------------------------------------------------------


def test_messages_stream_from_recorded_tool_calls_follows_anthropics_grammar() -> None:
    tr = MessagesTranslator(CTX)
    tr.request({"model": "alias-m", "max_tokens": 500, "stream": True, "messages": HI, "tools": [WEATHER_ANTHROPIC],
                "thinking": {"type": "enabled", "budget_tokens": 1024}})
    raw, usage, _ = run_stream(tr, "chat-tools")
    events = sse_events(raw)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use", "tool_use"]
    assert [d["index"] for n, d in events if n == "content_block_start"] == [0, 1, 2]
    signature = next(d["delta"]["signature"] for n, d in events if n == "content_block_delta"
                     and d["delta"]["type"] == "signature_delta")
    assert CTX.seal.open(signature) == "Use the tool."  # the reasoning travels back in the signature
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] == usage.completion_tokens
    assert events[0][1]["message"]["model"] == "alias-m"


def test_messages_json_from_recorded_text() -> None:
    tr = MessagesTranslator(CTX)
    tr.request({"model": "m", "max_tokens": 500, "messages": HI, "thinking": {"type": "adaptive",
                                                                              "display": "omitted"}})
    usage = tr.response((RECORDINGS / "chat-text.json").read_bytes())
    assert usage is not None
    body = json.loads(tr.render(usage, 0))
    assert [b["type"] for b in body["content"]] == ["thinking", "text"]
    assert body["content"][0]["thinking"] == "" and CTX.seal.open(body["content"][0]["signature"]) == "Greet back."
    assert body["content"][1]["text"] == "Hello there, friend." and body["stop_reason"] == "end_turn"
    assert "cost" not in body["usage"]


def test_messages_length_and_keepalive_order() -> None:
    tr = MessagesTranslator(CTX)
    tr.request({"model": "m", "max_tokens": 5, "stream": True, "messages": HI})
    first, second = tr.keepalive(), tr.keepalive()
    assert first.startswith(b"event: message_start") and second.startswith(b"event: ping")
    raw, _, _ = run_stream(tr, "chat-length")
    events = sse_events(first + second + raw)
    assert [n for n, _ in events].count("message_start") == 1
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


# -- Responses ----------------------------------------------------------------------------------------------


def test_responses_stream_from_recorded_tool_calls() -> None:
    tr = ResponsesTranslator(CTX)
    tr.request({"model": "m", "input": "weather?", "stream": True,
                "tools": [{"type": "function", "name": "get_weather", "description": "Weather.",
                           "parameters": {"type": "object", "properties": {}}}]})
    raw, usage, _ = run_stream(tr, "chat-tools")
    events = [d for _, d in sse_events(raw)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == ["reasoning", "function_call", "function_call"]
    assert [json.loads(i["arguments"])["city"] for i in done[1:]] == ["Paris", "Oslo"]
    final = events[-1]["response"]
    assert final["usage"]["output_tokens"] == usage.completion_tokens and "cost" not in final["usage"]


def test_responses_keepalive_is_small_and_names_the_response() -> None:
    tools = [{"type": "function", "name": f"t{i}", "description": "x" * 400, "parameters": {}} for i in range(20)]
    tr = ResponsesTranslator(CTX)
    tr.request({"model": "m", "input": "hi", "stream": True, "tools": tools})
    opening = tr.keepalive()
    later = tr.keepalive()
    assert opening.count(b"event: ") == 2 and len(opening) > 8000  # created + in_progress, the whole skeleton
    assert len(later) < 300 and b'"status":"in_progress"' in later


def test_responses_json_from_recorded_length_is_incomplete() -> None:
    tr = ResponsesTranslator(CTX)
    tr.request({"model": "m", "input": "hi", "max_output_tokens": 5})
    usage = tr.response((RECORDINGS / "chat-length.json").read_bytes())
    assert usage is not None
    body = json.loads(tr.render(usage, 10))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["cost"] == 0.00000001


@pytest.mark.parametrize("name", ["chat-text", "chat-tools", "chat-length"])
def test_sse_parser_gives_the_same_payloads_however_the_bytes_arrive(name: str) -> None:
    """Whole events per read take a fast path; splits, CRLF, comments and several `data:`
    lines take the general one: every way of feeding a recording yields the same payloads."""
    import random

    raw = (RECORDINGS / f"{name}.sse").read_bytes()
    whole = payloads(name)
    events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
    assert [p for e in events for p in SSEParser(1 << 20).feed(e)] == whole  # one event per read
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(raw)), 8))
        parser = SSEParser(1 << 20)
        got = [p for a, b in zip([0, *cuts], [*cuts, len(raw)]) for p in parser.feed(raw[a:b])]
        assert got == whole
    crlf = SSEParser(1 << 20)
    assert [p for e in events for p in crlf.feed(e.replace(b"\n", b"\r\n"))] == whole
    mixed = SSEParser(1 << 20).feed(b": keepalive\n\n" + events[0] + b"event: x\ndata: {}\n\n")
    assert mixed == [whole[0], b"{}"]


@pytest.mark.parametrize("piece", [
    b"data: a\n\ndata: b\n\n", b"data: a\n\ndata:b\n\n", b"data: a\ndata: b\n\n", b"data: a\n\n\n\ndata: b\n\n",
    b"data: \n\n", b"data: a\n\n: comment\n\n", b"data: a\n\nevent: x\ndata: b\n\n", b"data: a\r\n\r\n",
    b"data:  two spaces\n\n", b"data: a\n\ndata: b\n\ndata: [DONE]\n\n",
    b"data: a\n\ndata: b\n\ndata: c", b"data: a\n\ndata: b\n\nda", b"data: a\n\ndata: b\n\ndata: c\r",
    b"data: a\n\ndata: b\n\ndata: c\n", b"data: a", b"data: a\n\n\n",
    b"data: a\n\ndata:  b\n\n", b"data: a\n\ndata: b\nid: 7\n\ndata: c\n\n", b"data: a\n\ndata: \n\n",
    b"data: a\n\n", b"data: [DONE]\n\n", b"data:  a\n\n", b"data: a\nid: 1\n\n", b"data: a\n\n\n\n", b"data: a\r\n\n",
])
def test_the_sse_fast_path_reads_what_the_general_path_reads(piece: bytes) -> None:
    """Whole events, and a read that ends mid-event (large reads do): the same payloads, and the
    same rest kept for the next read, as the general path gives."""
    fast, general = SSEParser(1 << 20), SSEParser(1 << 20)
    assert fast.feed(piece) == general._events(piece)
    assert fast._buf == general._buf
    assert fast.feed(b"x\n\n") == general.feed(b"x\n\n")


def test_sse_parser_refuses_an_event_over_the_limit_on_either_path() -> None:
    event = b"data: " + b"x" * 100 + b"\n\n"
    for piece in (event, event[:50]):  # whole (fast path) or split (general path)
        parser = SSEParser(64)
        with pytest.raises(GatewayError):
            parser.feed(piece)
            parser.feed(event[50:])


def _backend_stream(chat: bool, model: str = "backend-m", continuous: bool = False,
                    thinking: bool = False) -> list[bytes]:
    """A vLLM stream: role chunk, text (reasoning first if `thinking`), an empty text, the end,
    usage, [DONE]; with `continuous`, the running usage on every chunk too."""
    def chunk(piece: dict[str, Any] | None, finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
        if chat:
            choices = [{"index": 0, "delta": piece if piece is not None else {}, "logprobs": None,
                        "finish_reason": finish}] if piece is not None or finish else []
            obj: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": model,
                                   "choices": choices}
        else:
            choices = [{"index": 0, "text": (piece or {}).get("content", ""), "logprobs": None,
                        "finish_reason": finish}] if piece is not None or finish else []
            obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": model, "choices": choices}
        if usage:
            obj["usage"] = usage
        return orjson.dumps(obj)

    texts = ["Hel", "lo", "", ' "model":"backend-m" ', ' "usage" {"error"', "!", "\\n", "end"]
    pieces = [{"reasoning": t} for t in ("Think", "ing.")] if thinking else []
    pieces += [{"role": "assistant", "content": ""}] if chat else []
    pieces += [{"content": t} for t in texts]
    out = [chunk(p, usage={"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n} if continuous else None)
           for n, p in enumerate(pieces)]
    final = {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces)}
    out += [chunk({}, finish="stop", usage=final if continuous else None), chunk(None, usage=final)]
    return out + [b"[DONE]"]


def _fresh(protocol: str) -> Translator:
    body: dict[str, Any] = {"model": "m", "stream": True}
    if protocol == "chat":
        tr: Translator = ChatTranslator(CTX)
        body["messages"] = HI
    elif protocol == "completions":
        tr = CompletionsTranslator(CTX)
        body.update(prompt="hi", max_tokens=9)
    elif protocol == "messages":
        tr = MessagesTranslator(CTX)
        body.update(messages=HI, max_tokens=99, thinking={"type": "enabled", "budget_tokens": 50})
    else:
        tr = ResponsesTranslator(CTX)
        body.update(input="hi", reasoning={"effort": "low"})
    tr.request(body)
    return tr


def _parsing_only(tr: Translator) -> Translator:
    """The translator with its text-run reader unable to learn a skeleton: every payload parsed."""
    runs = getattr(tr, "_runs", None)
    if runs is not None:
        runs._learns = text_runs._LEARNS
    return tr


def _drive(tr: Translator, payloads: list[bytes], size: int, most: int, runs: bool) -> tuple[bytes, int, int]:
    """Feed `payloads` in reads of `size` the way the pipeline does (taking runs where the translator
    offers them, if `runs`); (what the client gets with ids and times blanked, output pieces, payloads taken
    in runs)."""
    out, delivered, taken, usage = [], 0, 0, None
    for start in range(0, len(payloads), size):
        read = payloads[start:start + size]
        i = 0
        while i < len(read):
            got = tr.chunks(read, i, most) if runs and len(read) - i > 1 else None
            if got is not None:
                frames, reported, pieces, n = got
                assert 1 <= n <= min(most, len(read) - i)
                out.append(frames)
                usage, delivered, taken, i = reported or usage, delivered + pieces, taken + n, i + n
                continue
            frames, reported, pieces, done = tr.chunk(read[i])
            out.append(frames)
            usage, delivered, i = reported or usage, delivered + pieces, i + 1
            if done:
                break
    assert usage is not None
    out.append(tr.finish(usage, 1234))
    out_bytes = re.sub(rb"(msg|resp|rs|fc|toolu|call)_[0-9a-f]{24}", b"ID", b"".join(out))
    return re.sub(rb'"created_at":\d+', b'"created_at":T', out_bytes), delivered, taken  # two runs may straddle a second


@pytest.mark.parametrize("protocol", ["messages", "responses"])
@pytest.mark.parametrize("continuous", [False, True])
def test_a_paced_stream_reads_its_text_deltas_by_the_skeleton(protocol: str, continuous: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of one payload (a model server's pace: a token a read) is read by its bytes once
    a text delta taught the skeleton: the same bytes as every payload parsed, far fewer parses."""
    payloads = _backend_stream(True, continuous=continuous, thinking=True)
    texts = [p for p in payloads if b'"content":"' in p and b'"role"' not in p and b'"content":""' not in p]
    calls: list[bytes] = []
    loads = orjson.loads
    monkeypatch.setattr(orjson, "loads", lambda raw: calls.append(raw) or loads(raw))
    lone, _, _ = _drive(_fresh(protocol), payloads, 1, 99, runs=True)
    parsed_lone = [p for p in calls if p in texts]
    calls.clear()
    parsed, _, _ = _drive(_parsing_only(_fresh(protocol)), payloads, 1, 99, runs=True)
    assert lone == parsed
    assert len(parsed_lone) <= 2 < len(texts), "the first text delta and the one with a new field are parsed"
    assert sum(p in texts for p in calls) == len(texts)


@pytest.mark.parametrize("protocol", ["chat", "completions", "messages", "responses"])
@pytest.mark.parametrize("continuous", [False, True])
def test_a_read_taken_in_runs_gives_what_its_payloads_give_one_by_one(protocol: str, continuous: bool) -> None:
    """Translator.chunks (a run of payloads at once, the fast path) against chunk() alone: the same
    bytes for the client, the same output pieces, on reads of every size and with a budget."""
    payloads = _backend_stream(protocol != "completions", continuous=continuous,
                               thinking=protocol in ("messages", "responses"))
    for size, most in ((2, 99), (3, 99), (4, 99), (len(payloads), 99), (len(payloads), 3), (len(payloads), 1)):
        whole, whole_pieces, taken = _drive(_fresh(protocol), payloads, size, most, runs=True)
        single, single_pieces, _ = _drive(_fresh(protocol), payloads, size, most, runs=False)
        parsed, parsed_pieces, _ = _drive(_parsing_only(_fresh(protocol)), payloads, size, most, runs=False)
        assert whole == single == parsed, (size, most)
        assert whole_pieces == single_pieces == parsed_pieces, (size, most)
        assert b"backend-m" not in whole.replace(b'\\"model\\":\\"backend-m\\"', b""), "the model is renamed"
        if size > 3 and most > 1 and not (continuous and protocol in ("chat", "completions")):
            # (usage on every chunk is looked at one by one where the chunks pass through)
            assert taken, f"the fast path never applied (reads of {size})"


def test_text_deltas_from_templates_are_the_bytes_the_dicts_would_encode_to() -> None:
    """Messages' content_block_delta and Responses' output_text.delta are written from byte templates."""
    from kiln.protocols.anthropic import blocks
    from kiln.protocols.openai import responses_output
    from kiln.protocols.base import sse_event

    for text in ("plain", 'quote " and \\ backslash', "newline\n", "ünïcödé ✓", "\u2028"):
        body = orjson.dumps(text)[1:-1]
        assert blocks._TEXT_HEAD % 3 + body + blocks._TEXT_TAIL == sse_event("content_block_delta", {
            "type": "content_block_delta", "index": 3, "delta": {"type": "text_delta", "text": text}})
        assert responses_output._TEXT_DELTA % (7, b"msg_1", 2, body) == sse_event(
            "response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 7,
                                           "item_id": "msg_1", "output_index": 2, "content_index": 0,
                                           "delta": text, "logprobs": []})

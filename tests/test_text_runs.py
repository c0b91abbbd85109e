"""TextRuns reads plain text deltas by their bytes: it must take exactly what a full parse takes.

The reference below parses every payload (what the fast path replaces); each case feeds the
same payloads to both and compares the run taken, its texts and its usage. The hostile cases
are payloads whose bytes fit the learned skeleton around a text that is not one valid JSON
string body: the run must end before them, where the pipeline's full path answers them.
"""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from kiln.core.records import Usage
from kiln.protocols.text_runs import TEXT_KEYS, TextRuns, body_of, decode


def chunk(text: str | None = None, *, field: str = "content", usage: dict[str, int] | None = None,
          finish: str | None = None, created: int = 1, raw_text: bytes | None = None) -> bytes:
    """A vLLM chat chunk; `raw_text`: these bytes in place of the encoded text (hostile cases)."""
    delta: dict[str, Any] = {} if text is None and raw_text is None else {field: text if text is not None else "@"}
    data: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": created, "model": "m",
                            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        data["usage"] = usage
    out = orjson.dumps(data)
    if raw_text is not None:
        out = out.replace(b'"@"', b'"' + raw_text + b'"', 1)
    return out


def reference(payloads: list[bytes], start: int, most: int) -> tuple[list[tuple[str, str]], Any, int]:
    """Every payload parsed: the plain text deltas from `start`, the last usage, how many."""
    texts: list[tuple[str, str]] = []
    usage = None
    i = start
    while i < min(len(payloads), start + most):
        try:
            data = orjson.loads(payloads[i])
        except orjson.JSONDecodeError:
            break
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            break
        delta = choices[0].get("delta")
        if choices[0].get("finish_reason") is not None or not isinstance(delta, dict) or len(delta) != 1:
            break
        (field, text), = delta.items()
        if field not in TEXT_KEYS or not isinstance(text, str) or not text:
            break
        texts.append((field, text))
        usage = data.get("usage", usage)
        i += 1
    return texts, usage, i - start


def flat(groups: list[tuple[str, list[bytes]]]) -> list[tuple[str, str]]:
    return [(field, decode([body])) for field, bodies in groups for body in bodies]


def same(payloads: list[bytes], start: int = 0, most: int = 10**6, runs: TextRuns | None = None) -> int:
    """TextRuns and the reference agree from `start`; how many they took."""
    groups, usage, taken = (runs or TextRuns()).take(payloads, start, most)
    texts, ref_usage, ref_taken = reference(payloads, start, most)
    assert (flat(groups), taken) == (texts, ref_taken)
    assert usage == (Usage.from_openai(ref_usage) if ref_usage is not None else None)
    for (f1, _), (f2, _) in zip(groups, groups[1:]):
        assert f1 != f2, "a field's deltas in a row are one group"
    return taken


def usage_at(n: int) -> dict[str, int]:
    return {"prompt_tokens": 5, "total_tokens": 5 + n, "completion_tokens": n}


WORDS = ["Hi", " there", ' "quoted"', " back\\slash", "\n", " ünï", " ✓", "\u2028", "\t", " {}", '"}', "\\"]


@pytest.mark.parametrize("continuous", [False, True])
def test_a_plain_run_is_read_whole_with_its_last_usage(continuous: bool) -> None:
    payloads = [chunk(w, usage=usage_at(k) if continuous else None) for k, w in enumerate(WORDS * 3)]
    payloads += [chunk("end", finish="stop"), chunk(usage=usage_at(99)), b"[DONE]"]
    assert same(payloads) == len(WORDS) * 3
    runs = TextRuns()
    assert same(payloads, 0, 2, runs) == 2  # `most` bounds the run; the skeleton carries over
    assert same(payloads, 2, 10**6, runs) == len(WORDS) * 3 - 2


def test_reasoning_then_content_are_two_groups() -> None:
    payloads = [chunk(w, field="reasoning") for w in ("Let", " me", " think")]
    payloads += [chunk(w, field="reasoning_content") for w in (" more",)]
    payloads += [chunk(w) for w in ("The", " answer", " is", " 4")]
    assert same(payloads) == len(payloads)


@pytest.mark.parametrize("raw", [
    b'a","x":"b',  # a second key in the delta: fits the skeleton's bytes, not its structure
    b'a"},"x":{"content":"b',  # a key beside the delta: valid, and plain ("a"), but not by the fast path
    b"trailing\\",  # the closing quote escaped
    b"bad \\q escape",
    b"short \\u12",
    b"raw \x01 control",
    b"bad utf-8 \xff",
    b"\xc3",  # half a character
])
@pytest.mark.parametrize("continuous", [False, True])
def test_a_body_that_is_not_one_valid_string_is_not_read_by_its_bytes(raw: bytes, continuous: bool) -> None:
    u = (lambda k: usage_at(k)) if continuous else (lambda k: None)
    payloads = [chunk(w, usage=u(k)) for k, w in enumerate(["a", "b", "c"])]
    payloads += [chunk(raw_text=raw, usage=u(3)), chunk("d", usage=u(4))]
    taken = same(payloads)
    try:
        orjson.loads(payloads[3])
    except orjson.JSONDecodeError:
        assert taken == 3  # the run ends before it; the full path answers it (a 502)


@pytest.mark.parametrize("usage", [b'"text"', b"[1]", b"{", b'{"a":1},{"b":2}', b"1", b"{}"])
def test_a_usage_that_is_not_an_object_is_not_read_by_its_bytes(usage: bytes) -> None:
    payloads = [chunk(w, usage=usage_at(k)) for k, w in enumerate(["a", "b", "c", "d"])]
    payloads[2] = payloads[2].replace(orjson.dumps(usage_at(2)), usage)
    taken = same(payloads)
    try:
        orjson.loads(payloads[2])
    except orjson.JSONDecodeError:
        assert taken == 2


@pytest.mark.parametrize("usage", [
    b'{"a":1},"choices":[]', b'{"a":1},"choices":{}', b'1,"choices":{}', b'{"a":{"b":1}}', b'{"a":"}"}', b'{"a":"{"}',
    b'[{"a":1}]', b'{"a":1}\x00{', b'{"a":1}, "x":{}',
])
@pytest.mark.parametrize("at", [0, 2, 3])
def test_json_a_parse_reads_otherwise_ends_the_run_before_it(usage: bytes, at: int) -> None:
    """Only a run's last usage is parsed; the others are checked to be flat objects, so a valid
    payload whose usage closes early and adds keys (a duplicate `choices`) is never taken."""
    payloads = [chunk(w, usage=usage_at(k)) for k, w in enumerate(["a", "b", "c", "d"])]
    payloads[at] = payloads[at].replace(orjson.dumps(usage_at(at)), usage)
    same(payloads)  # the one that is no JSON (a NUL in it) is not flat either: the run ends before it too


@pytest.mark.parametrize("usage", [b'{"prompt_tokens":}', b'{"prompt_tokens":1,,}', b'{"a" 1}', b"{}"])
def test_a_malformed_flat_usage_the_run_does_not_report_is_taken(usage: bytes) -> None:
    """Its payload is no JSON, its usage unused: the run takes its text (a full parse would
    refuse the chunk). The run's last usage is parsed, and the run ends before a bad one."""
    payloads = [chunk(w, usage=usage_at(k)) for k, w in enumerate(["a", "b", "c", "d"])]
    payloads[1] = payloads[1].replace(orjson.dumps(usage_at(1)), usage)
    groups, reported, taken = TextRuns().take(payloads, 0, 10**6)
    assert (flat(groups), taken, reported) == ([("content", w) for w in "abcd"], 4, Usage.from_openai(usage_at(3)))
    groups, reported, taken = TextRuns().take(payloads, 0, 2)  # now the bad one is the last
    valid = usage == b"{}"
    assert (taken, reported) == ((2, Usage.from_openai({})) if valid else (1, Usage.from_openai(usage_at(0))))


def test_chunks_that_differ_elsewhere_are_parsed_one_by_one() -> None:
    """llama.cpp stamps each chunk with the second it was made: the skeleton rarely fits."""
    payloads = [chunk(f"w{k}", created=k // 3) for k in range(40)]
    assert same(payloads) == 40
    payloads = [chunk(f"w{k}", created=k) for k in range(40)]
    assert same(payloads) == 40


def test_what_is_not_a_plain_text_delta_ends_the_run() -> None:
    head = [chunk("a"), chunk("b")]
    for other in (chunk(None), chunk(""), chunk("x", finish="stop"), chunk("x", field="refusal"),
                  chunk(usage=usage_at(2)), b'{"error":{"message":"boom"}}', b"[DONE]", b"not json",
                  orjson.dumps({"choices": [{"delta": {"content": "a"}}, {"delta": {"content": "b"}}]})):
        assert same([*head, other, chunk("c")]) == 2


KINDS = ["plain"] * 12 + ["reasoning", "escaped", "finish", "usage", "created", "hostile", "empty"]
GARBLED = [b'{"a":1},"choices":[]', b'1,"choices":{}', b"[1]", b'{"a":}', b"{", b'{"prompt_tokens":1,,}']


def random_chunk(rnd: random.Random, kind: str, k: int, continuous: bool) -> bytes:
    """The k-th chunk of a random stream, of one kind (KINDS, or `garbled`: a usage no object)."""
    u = usage_at(k) if continuous else None
    return {
        "plain": lambda: chunk(rnd.choice(WORDS), usage=u),
        "reasoning": lambda: chunk(rnd.choice(WORDS), field="reasoning", usage=u),
        "escaped": lambda: chunk(rnd.choice(WORDS) * 3 + "\u0007", usage=u),
        "finish": lambda: chunk("x", finish="length", usage=u),
        "usage": lambda: chunk(usage=usage_at(k)),
        "created": lambda: chunk("t", created=rnd.randint(1, 3), usage=u),
        "hostile": lambda: chunk(raw_text=rnd.choice([b'a","x":"b', b"x\\", b"\x02", b"\xff"]), usage=u),
        "empty": lambda: chunk("", usage=u),
        "garbled": lambda: chunk("g", usage=usage_at(k)).replace(orjson.dumps(usage_at(k)), rnd.choice(GARBLED)),
    }[kind]()


def test_random_streams_agree_with_a_full_parse() -> None:
    rnd = random.Random(7)
    for _ in range(300):
        continuous = rnd.random() < 0.5
        payloads = [random_chunk(rnd, rnd.choice(KINDS), k, continuous) for k in range(rnd.randint(1, 30))]
        runs, i = TextRuns(), 0
        while i < len(payloads):  # as the pipeline goes: a run, else one payload on its own
            i += same(payloads, i, rnd.randint(1, 40), runs) or 1


def test_bodies_are_the_text_encoded() -> None:
    for text in WORDS:
        assert decode([body_of(text)]) == text
    assert decode([body_of(w) for w in WORDS]) == "".join(WORDS)


@pytest.mark.parametrize("continuous", [False, True])
def test_a_long_run_is_parsed_once_not_per_chunk(continuous: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    payloads = [chunk(f" w{k}", usage=usage_at(k) if continuous else None) for k in range(200)]
    calls = []
    loads = orjson.loads
    monkeypatch.setattr(orjson, "loads", lambda raw: calls.append(raw) or loads(raw))
    runs = TextRuns()
    groups, usage, taken = runs.take(payloads, 0, 10**6)
    assert taken == 200 and len(groups[0][1]) == 200
    assert len(calls) <= 4, "one full parse to learn, one to check the skeleton, one for the usages"
    assert usage == (Usage.from_openai(usage_at(199)) if continuous else None)


def test_random_usages_never_read_valid_json_otherwise() -> None:
    """Continuous-usage streams with some usage objects garbled (valid JSON a parse reads
    otherwise, and no JSON at all): a run takes a payload only if a full parse calls it a plain
    text delta, or if it is no JSON and its usage is one flat object; it reports the last taken
    payload's usage, parsed."""
    rnd = random.Random(3)
    odd = [b'{"a":1},"choices":[]', b'1,"choices":{}', b'{"a":{"b":1}}', b'[1]', b'"x"', b'{"a":1}, "x":{}',
           b'{"a":}', b'{"a" 1}', b'{', b'{"prompt_tokens":1,,}', b"{}", b'{"a":"}"}']
    taken_odd = 0
    for _ in range(400):
        payloads = []
        for k in range(rnd.randint(2, 30)):
            p = chunk(rnd.choice(WORDS), usage=usage_at(k))
            if rnd.random() < 0.15:
                p = p.replace(orjson.dumps(usage_at(k)), rnd.choice(odd))
            payloads.append(p)
        runs, i = TextRuns(), 0
        while i < len(payloads):
            groups, usage, taken = runs.take(payloads, i, rnd.randint(1, 40))
            texts = flat(groups)
            assert len(texts) == taken
            for j, p in enumerate(payloads[i:i + taken]):
                try:
                    data = orjson.loads(p)
                except orjson.JSONDecodeError:
                    inner = p[p.rindex(b'"usage":') + 8:-1]
                    assert inner[:1] == b"{" and inner[-1:] == b"}" and b"{" not in inner[1:-1] \
                        and b"}" not in inner[1:-1], p
                    taken_odd += 1
                    continue
                assert reference([p], 0, 1)[2] == 1, p
                assert texts[j] == ("content", data["choices"][0]["delta"]["content"])
            if taken:
                last = payloads[i + taken - 1]
                try:
                    reported = orjson.loads(last).get("usage")
                except orjson.JSONDecodeError:  # no JSON: its usage bytes, which must parse
                    reported = orjson.loads(last[last.rindex(b'"usage":') + 8:-1])
                assert usage == Usage.from_openai(reported)
            i += taken or 1
    assert taken_odd > 20, "malformed flat usages were taken mid-run"


def test_a_lone_payload_is_read_as_a_full_parse_reads_it_or_left_to_one() -> None:
    """`one` (a read of one payload, a paced stream's every read) takes a payload only as the
    reference would, with its text and usage; what it leaves is parsed, and `learn` learns the
    skeleton from a parsed plain delta. Random streams of every kind, hostile bodies and garbled
    usages included."""
    rnd = random.Random(11)
    fast = 0
    for _ in range(300):
        continuous = rnd.random() < 0.5
        runs = TextRuns()
        for k in range(rnd.randint(1, 30)):
            p = random_chunk(rnd, rnd.choice([*KINDS, "garbled"]), k, continuous)
            texts, ref_usage, ref_taken = reference([p], 0, 1)
            got = runs.one(p)
            if got is None:
                try:
                    runs.learn(p, orjson.loads(p))
                except orjson.JSONDecodeError:
                    pass  # the full path's 502
                continue
            fast += 1
            field, body, usage = got
            assert ref_taken == 1 and [(field, decode([body]))] == texts, p
            assert usage == (Usage.from_openai(ref_usage) if ref_usage is not None else None), p
    assert fast > 1000, "the skeleton read most plain deltas"


@pytest.mark.parametrize("raw", [b'a","x":"b', b"trailing\\", b"bad \\q escape", b"raw \x01 control", b"\xc3"])
@pytest.mark.parametrize("continuous", [False, True])
def test_a_lone_body_that_is_not_one_valid_string_is_left_to_the_full_parse(raw: bytes, continuous: bool) -> None:
    runs = TextRuns()
    first = chunk("a", usage=usage_at(0) if continuous else None)
    assert runs.one(first) is None, "nothing learned yet"
    runs.learn(first, orjson.loads(first))
    assert runs.one(chunk("b", usage=usage_at(1) if continuous else None)) == (
        "content", b"b", Usage.from_openai(usage_at(1)) if continuous else None)
    assert runs.one(chunk(raw_text=raw, usage=usage_at(2) if continuous else None)) is None


@pytest.mark.parametrize("usage", [b'"text"', b"[1]", b"{", b'{"a":1},"choices":[]', b'{"prompt_tokens":1,,}'])
def test_a_lone_usage_that_is_not_an_object_is_left_to_the_full_parse(usage: bytes) -> None:
    runs = TextRuns()
    first = chunk("a", usage=usage_at(0))
    runs.learn(first, orjson.loads(first))
    assert runs.one(chunk("b", usage=usage_at(1)).replace(orjson.dumps(usage_at(1)), usage)) is None

"""The access log (kiln/access_log.py): one line per request, JSON or key=value text, by level.

These tests call `log_request` with real records and read what it writes to a stream; the
gateway's own lines are checked in test_observability.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import shlex
from decimal import Decimal
from typing import Iterator

import pytest

from kiln import access_log
from kiln.config import LogSettings
from kiln.core.keys import hash_key, new_key
from kiln.core.records import ApiKey, UsageEvent

SECRET = new_key()
KEY = ApiKey(id="key_1", project_id="proj_1", org_id="org_1", key_hash=hash_key(SECRET), prefix=SECRET[:12])
EVENT = UsageEvent(id="gen-abc", created_at=1.0, org_id="org_1", project_id="proj_1", key_id="key_1",
                   model="qwen3-32b", endpoint="chat.completions", prompt_tokens=812, cached_tokens=256,
                   completion_tokens=240, reasoning_tokens=30, cost_nano=123_456_789, ttft_ms=98.76,
                   duration_ms=1234.56, streamed=True, backend="http://user:pw@10.0.0.5:8000/v1")


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    yield out
    access_log.configure(LogSettings(), io.StringIO())  # leave no handler on this test's stream


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_line_of_a_metered_request(stream: io.StringIO) -> None:
    access_log.configure(LogSettings(format="auto"), stream)  # not a terminal: JSON
    access_log.log_request(status=200, endpoint="chat.completions", duration_ms=1240.04, event=EVENT, key=KEY)
    [line] = lines(stream)
    record = json.loads(line, parse_float=Decimal)
    assert record["cost"] == Decimal("0.123456789")  # exact, as a number
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record.pop("time"))
    assert record == {
        "generation_id": "gen-abc", "org_id": "org_1", "project_id": "proj_1", "key_id": "key_1",
        "model": "qwen3-32b", "endpoint": "chat.completions", "status": 200, "error": None,
        "prompt_tokens": 812, "cached_tokens": 256, "completion_tokens": 240, "reasoning_tokens": 30,
        "cost": Decimal("0.123456789"), "ttft_ms": Decimal("98.8"), "duration_ms": Decimal("1240.0"),
        "backend": "http://10.0.0.5:8000/v1", "cancelled": False,
    }
    assert SECRET not in line and KEY.key_hash not in line and "pw" not in line


def test_refused_request_and_text_format(stream: io.StringIO) -> None:
    access_log.configure(LogSettings(format="text"), stream)
    access_log.log_request(status=429, endpoint="messages", duration_ms=0.42, key=KEY, model="claude-sonnet-4-5",
                           error="rate_limited")
    access_log.log_request(status=401, endpoint="chat.completions", duration_ms=0.1, error="unauthorized")
    first, second = lines(stream)
    fields = dict(part.split("=", 1) for part in shlex.split(first))
    assert fields["status"] == "429" and fields["error"] == "rate_limited" and fields["key_id"] == "key_1"
    assert fields["model"] == "claude-sonnet-4-5" and fields["cost"] == "0" and fields["cancelled"] == "false"
    assert "generation_id" not in fields  # nothing was metered
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fields["time"])
    assert "key_id" not in dict(part.split("=", 1) for part in shlex.split(second))
    assert SECRET not in stream.getvalue()


def test_text_values_with_spaces_are_quoted(stream: io.StringIO) -> None:
    access_log.configure(LogSettings(format="text"), stream)
    access_log.log_request(status=400, endpoint="chat.completions", duration_ms=1, model='odd "model" name')
    fields = dict(part.split("=", 1) for part in shlex.split(lines(stream)[0]))
    assert fields["model"] == 'odd "model" name'


def test_level_warning_keeps_only_failures(stream: io.StringIO) -> None:
    access_log.configure(LogSettings(format="json", level="warning"), stream)
    access_log.log_request(status=200, endpoint="chat.completions", duration_ms=5, event=EVENT)
    access_log.log_request(status=429, endpoint="chat.completions", duration_ms=5, key=KEY)
    access_log.log_request(status=502, endpoint="chat.completions", duration_ms=5, event=EVENT, error="backend")
    [line] = lines(stream)
    assert json.loads(line)["status"] == 502
    access_log.configure(LogSettings(format="json", level="error"), stream)
    access_log.log_request(status=503, endpoint="chat.completions", duration_ms=5)
    assert len(lines(stream)) == 1


def test_terminal_gets_text(stream: io.StringIO) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    access_log.configure(LogSettings(format="auto"), tty)
    access_log.log_request(status=200, endpoint="completions", duration_ms=3, event=EVENT)
    assert tty.getvalue().startswith("time=")


class CountingStream(io.StringIO):
    writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def test_the_lines_of_a_tenth_of_a_second_go_out_in_one_write() -> None:
    stream = CountingStream()
    access_log.configure(LogSettings(format="json"), stream)

    async def serve() -> None:
        for status in (200,) * 49 + (503,):
            access_log.log_request(status=status, endpoint="chat.completions", duration_ms=1.0, event=EVENT)
            await asyncio.sleep(0)  # turns of the loop go by: the lines wait
        assert stream.writes == 0
        await asyncio.sleep(access_log.FLUSH_S * 1.5)
        assert stream.writes == 1
        for _ in range(access_log.MAX_PENDING):  # so many at once are written without waiting
            access_log.log_request(status=200, endpoint="chat.completions", duration_ms=1.0, event=EVENT)
        assert stream.writes == 2

    try:
        asyncio.run(serve())
        assert [json.loads(line)["status"] for line in lines(stream)][:50] == [200] * 49 + [503]
        assert len(lines(stream)) == 50 + access_log.MAX_PENDING
        access_log.log_request(status=200, endpoint="chat.completions", duration_ms=1.0, key=KEY)
        assert stream.writes == 3 and len(lines(stream)) == 51 + access_log.MAX_PENDING, \
            "without a loop a line goes out at once"
    finally:
        access_log.configure(LogSettings(), io.StringIO())

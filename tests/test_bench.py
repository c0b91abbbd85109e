"""The benchmark harness (bench/): it runs end to end, Kiln's app serves on Granian, and the
long-stream verdict tells a linear cost from a quadratic one.

The runs are one-second smoke runs: they check that the harness works against the current
gateway (its checks of every answer and of the usage ledger make it exit 1 otherwise), not speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import agent_bodies  # noqa: E402
import report  # noqa: E402
from measure import LongRow  # noqa: E402


def bench(*args: str, timeout: float = 300) -> str:
    out = subprocess.run([sys.executable, str(BENCH / "run.py"), "--duration", "1", "--warmup", "0", *args],
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_table_through_kiln_and_the_bare_proxy() -> None:
    out = bench("--sections", "table", "--protocols", "chat,messages", "--modes", "json",
                "--targets", "direct,bare,kiln", "--concurrency", "1")
    for protocol in ("chat", "messages"):
        for target in ("direct", "bare proxy", "Kiln"):
            assert f"| {protocol} | json | 1 | {target} |" in out
    assert "usage ledger:" in out and "MISMATCH" not in out


def test_kiln_app_runs_unchanged_on_granian() -> None:
    pytest.importorskip("granian")
    out = bench("--sections", "table", "--protocols", "chat,responses,messages", "--modes", "stream",
                "--targets", "direct,kiln", "--concurrency", "1", "--server", "granian")
    assert "server: granian" in out
    assert "| messages | stream | 1 | Kiln |" in out and "n/a" not in out


def test_long_stream_verdict_tells_linear_from_quadratic() -> None:
    def rows(protocol: str, cost: Callable[[int], float]) -> list[LongRow]:
        return [LongRow(protocol, "kiln", n, 10, cost(n)) for n in (20, 8192, 32768)]

    linear = rows("chat", lambda n: 1.0 + n * 0.003)  # ms per stream
    quadratic = rows("messages", lambda n: 1.0 + n * 0.003 + n * n * 4e-7)
    text, verdicts = report.long_table(linear + quadratic)
    assert verdicts == {("chat", "kiln"): True, ("messages", "kiln"): False}
    assert "GROWS" in text


@pytest.mark.parametrize("build", [agent_bodies.claude_code_messages, agent_bodies.codex_responses])
def test_agent_bodies_are_about_60_kb(build: Callable[[str, str], dict[str, Any]]) -> None:
    body = build("m", "[tag]")
    assert 55_000 <= len(json.dumps(body)) <= 66_000
    assert body["stream"] is True and body["tools"]

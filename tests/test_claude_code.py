"""Claude Code itself against Kiln and the simulator, with nothing but 127.0.0.1 reachable.

A pinned `@anthropic-ai/claude-code` (cached install, see e2e.py) runs headless
(`claude -p`) inside a loopback-only network namespace together with a
simulator and a gateway. Claude Code cannot add the simulator's `sim` control
object, so the simulator's `rules` script the model by what the latest turn
says: a greeting gets text (after a silent prefill, so pings come first), "the
magic command" gets a Bash tool call, and the Bash output gets a final answer.
Two more prompts make the backend refuse an oversized request in vLLM's two
wordings, to see Claude Code act on the Anthropic wording Kiln turns them into.
Every prompt runs once, when the module starts; the tests read the results.
The test process stays outside the namespace and reads the gateway's SQLite
ledger and the simulator's request log (fetched from inside).
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

from conftest import ADMIN_KEY, Gateway, Sim, start_gateway, start_sim, stop
from e2e import LoopbackNamespace, Turn, ledger_rows, npm_client, provision, upstream_bodies

VERSION = "2.1.332"
MODEL = "sim-coder"
RULES = [
    {"when": "say hi", "sim": {"reply": "Hello from the simulator.", "tool_calls": [], "ttft_ms": 1200}},
    {"when": "magic command", "sim": {"tool_calls": [
        {"name": "Bash", "arguments": {"command": "echo kiln-e2e", "description": "Print a marker"}}]}},
    {"when": "kiln-e2e", "sim": {"reply": "The command printed kiln-e2e.", "tool_calls": []}},
    {"when": "overflow please", "sim": {"status": 400, "error_message": (  # vLLM 0.33's wording
        "This model's maximum context length is 200000 tokens. However, your prompt contains 250000 input tokens, "
        "which exceeds this limit even without any output tokens. (parameter=input_tokens, value=250000)")}},
    {"when": "tight budget", "sim": {"status": 400, "error_message": (  # vLLM 0.16's wording
        "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's maximum context length is "
        "200000 tokens and your request has 190000 input tokens (32000 > 200000 - 190000).")}},
]
PROMPTS = ("say hi", "please run the magic command", "overflow please", "tight budget")


@dataclass
class Stack:
    ns: LoopbackNamespace
    sim: Sim
    gateway: Gateway
    env: dict[str, str]
    claude: str
    turns: dict[str, Turn] = field(default_factory=dict)

    def ask(self, prompt: str) -> None:
        before = len(self.upstream())
        done = self.ns.run([self.claude, "-p", prompt, "--allowedTools", "Bash"], env=self.env,
                           cwd=self.env["HOME"], capture_output=True, text=True, timeout=60)
        self.turns[prompt] = Turn(done, self.upstream()[before:])

    def upstream(self) -> list[dict[str, Any]]:
        return upstream_bodies(self.ns, self.sim.url)

    def ledger(self) -> list[sqlite3.Row]:
        return ledger_rows(self.gateway.data_dir)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    claude = str(npm_client("@anthropic-ai/claude-code", VERSION, "claude"))
    with LoopbackNamespace() as ns:
        sim = start_sim("--model", MODEL, "--reasoning-models", MODEL, "--max-model-len", "200000", ns=ns)
        gateway = start_gateway(f"""
[server]
keepalive_s = 0.5
[[models]]
id = "{MODEL}"
family = "qwen3"
context_window = 200000
max_output_tokens = 32000
aliases = ["claude-opus-5-5"]  # Claude Code's default model
prices = {{ input = "1", cached_input = "0.5", output = "2" }}
capabilities = {{ tool_choice = ["auto", "none"], reasoning = true }}
[[models.backends]]
url = "{sim.url}/v1"
""", ns=ns)
        try:
            key = provision(ns, gateway.url, sim.url, RULES, ADMIN_KEY, "claude-code")
            home = tempfile.mkdtemp(prefix="kiln-claude-")
            env = {"PATH": os.environ["PATH"], "HOME": home, "ANTHROPIC_BASE_URL": gateway.url,
                   "ANTHROPIC_API_KEY": key, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                   "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"}
            stack = Stack(ns, sim, gateway, env, claude)
            for prompt in PROMPTS:
                stack.ask(prompt)
            yield stack
        finally:
            stop(gateway.proc)
            stop(sim.proc)


def test_a_text_turn_completes_with_the_models_text(stack: Stack) -> None:
    turn = stack.turns["say hi"]
    assert turn.done.returncode == 0, turn.done.stderr
    assert turn.done.stdout.strip() == "Hello from the simulator."
    assert len(turn.upstream) == 1


def test_a_bash_tool_turn_runs_the_command_and_returns_the_result(stack: Stack) -> None:
    turn = stack.turns["please run the magic command"]
    assert turn.done.returncode == 0, turn.done.stderr
    assert turn.done.stdout.strip() == "The command printed kiln-e2e."
    call, answer = turn.upstream
    assert "Bash" in [t["function"]["name"] for t in call["tools"]]
    assert "billing-header" not in json.dumps(call["messages"])  # stripped, so the prefix cache can hit
    calling, result = answer["messages"][-2:]
    assert calling["tool_calls"][0]["function"]["name"] == "Bash"
    assert calling["reasoning"]  # Claude Code echoed the thinking block; it went back as reasoning
    assert result["role"] == "tool" and result["content"].strip() == "kiln-e2e"
    assert result["tool_call_id"] == calling["tool_calls"][0]["id"]


def test_an_overflow_is_reported_in_anthropic_wording_and_not_retried(stack: Stack) -> None:
    turn = stack.turns["overflow please"]
    assert turn.done.returncode == 1 and len(turn.upstream) == 1
    assert "Prompt is too long" in turn.done.stdout and "250000" in turn.done.stdout  # it parsed our numbers


def test_a_max_tokens_overflow_makes_claude_code_retry_with_less(stack: Stack) -> None:
    first, retry = stack.turns["tight budget"].upstream
    assert first["max_tokens"] == 32000 and retry["max_tokens"] <= 200000 - 190000


def test_the_ledger_shows_every_request_claude_code_made(stack: Stack) -> None:
    served = stack.turns["say hi"].upstream + stack.turns["please run the magic command"].upstream
    events = stack.ledger()  # the refused requests cost nothing and write no event
    assert len(events) == len(served) == 3
    assert {(e["endpoint"], e["model"], e["status"]) for e in events} == {("messages", MODEL, "ok")}
    assert all(e["prompt_tokens"] > 1000 and e["completion_tokens"] > 0 and e["cost_nano"] > 0 for e in events)
    assert events[-1]["cached_tokens"] > 1000  # the second request of a session reuses the first one's prefix

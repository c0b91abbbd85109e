"""Codex CLI itself against Kiln and the simulator, with nothing but 127.0.0.1 reachable.

A pinned `@openai/codex` (cached install, see e2e.py) runs headless (`codex
exec`) inside a loopback-only network namespace together with a simulator and a
gateway, as a custom provider (`wire_api = "responses"`, key from `env_key`)
whose model catalog is the gateway's `GET /v1/models`. Codex cannot add the
simulator's `sim` object, so the simulator's `rules` script the model by what
the latest turn says: a greeting gets text after a first token slower than
Codex's stream idle timeout (only keepalive events keep the turn alive), "edit
files" gets a shell call and an apply_patch call in one turn, their outputs get
a final answer, and the resumed session a last one. The resumed turn re-sends
the whole history, reasoning items included, which the gateway must turn back
into reasoning on the assistant messages. Every turn runs once, when the module
starts; the tests read the results. The test process stays outside the
namespace and reads the gateway's SQLite ledger and the simulator's request log.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import ADMIN_KEY, Gateway, Sim, start_gateway, start_sim, stop
from e2e import LoopbackNamespace, Turn, ledger_rows, npm_client, provision, upstream_bodies

VERSION = "0.171.0"
MODEL = "sim-coder"
THOUGHT = "KILN-THOUGHT: run the shell command, then add the file with a patch."
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from kiln\n*** End Patch\n"
RULES = [
    {"when": "kiln says hello", "sim": {"reply": "Hello from the simulator.", "tool_calls": [], "ttft_ms": 2500}},
    {"when": "kiln edits files", "sim": {"reasoning": THOUGHT, "tool_calls": [
        {"name": "exec_command", "arguments": {"cmd": "echo shell-ok > shell.txt"}},
        {"name": "apply_patch", "arguments": {"input": PATCH}}]}},
    {"when": "A hello.txt", "sim": {"reply": "Both tools ran.", "tool_calls": []}},  # apply_patch's output
    {"when": "kiln resumes", "sim": {"reply": "Resumed.", "tool_calls": []}},
]
TURNS = {"hello": ["kiln says hello"], "tools": ["kiln edits files"], "resume": ["resume", "--last", "kiln resumes"]}


@dataclass
class Stack:
    ns: LoopbackNamespace
    sim: Sim
    gateway: Gateway
    env: dict[str, str]
    codex: str
    work: Path
    turns: dict[str, Turn] = field(default_factory=dict)

    def config(self) -> list[str]:
        """The gateway as a custom provider; Codex gives up on a stream silent for 1.5 s, without retrying."""
        provider = (f'{{name="kiln", base_url="{self.gateway.url}/v1", env_key="KILN_API_KEY", wire_api="responses", '
                    f'model_catalog_url="{self.gateway.url}/v1/models", stream_idle_timeout_ms=1500, '
                    'stream_max_retries=0, request_max_retries=0}')
        return ["-c", "model_provider=kiln", "-c", f"model_providers.kiln={provider}",
                "-c", "analytics.enabled=false", "-c", "features.plugins=false"]

    def run(self, name: str, args: list[str]) -> None:
        before = len(self.upstream())
        cmd = [self.codex, "exec", "--skip-git-repo-check", "-s", "workspace-write", "-C", str(self.work),
               "-m", MODEL, *self.config(), *args]
        done = self.ns.run(cmd, env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        self.turns[name] = Turn(done, self.upstream()[before:])

    def upstream(self) -> list[dict[str, Any]]:
        return upstream_bodies(self.ns, self.sim.url)

    def catalog(self) -> list[dict[str, Any]]:
        """The model catalog Codex built from the gateway's GET /v1/models."""
        out = self.ns.run([self.codex, "debug", "models", *self.config()], env=self.env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout)["models"]  # type: ignore[no-any-return]

    def ledger(self) -> list[sqlite3.Row]:
        return ledger_rows(self.gateway.data_dir)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    codex = str(npm_client("@openai/codex", VERSION, "codex"))
    with LoopbackNamespace() as ns:
        sim = start_sim("--model", MODEL, "--reasoning-models", MODEL, ns=ns)
        gateway = start_gateway(f"""
[server]
keepalive_s = 0.5
[[models]]
id = "{MODEL}"
family = "qwen3"
context_window = 32768
max_output_tokens = 8192
prices = {{ input = "1", cached_input = "0.5", output = "2" }}
capabilities = {{ tool_choice = ["auto", "none"], parallel_tool_calls = true, reasoning = true }}
[[models.backends]]
url = "{sim.url}/v1"
""", ns=ns)
        try:
            key = provision(ns, gateway.url, sim.url, RULES, ADMIN_KEY, "codex")
            home = tempfile.mkdtemp(prefix="kiln-codex-")
            env = {"PATH": os.environ["PATH"], "HOME": home, "CODEX_HOME": home, "KILN_API_KEY": key}
            stack = Stack(ns, sim, gateway, env, codex, Path(tempfile.mkdtemp(prefix="kiln-codex-work-")))
            for name, args in TURNS.items():
                stack.run(name, args)
            yield stack
        finally:
            stop(gateway.proc)
            stop(sim.proc)


def test_codex_reads_the_gateway_model_catalog(stack: Stack) -> None:
    [model] = stack.catalog()
    assert (model["slug"], model["context_window"]) == (MODEL, 32768)
    assert model["apply_patch_tool_type"] == "freeform"
    assert [level["effort"] for level in model["supported_reasoning_levels"]] == ["low", "medium", "high"]


def test_a_text_turn_outlives_codex_idle_timeout_on_keepalives(stack: Stack) -> None:
    """The first token takes 2.5 s; Codex gives up on a stream silent for 1.5 s and may not retry."""
    turn = stack.turns["hello"]
    assert turn.done.returncode == 0, turn.done.stderr
    assert "Hello from the simulator." in turn.done.stdout
    assert len(turn.upstream) == 1


def test_a_turn_with_the_shell_tool_and_apply_patch_completes(stack: Stack) -> None:
    turn = stack.turns["tools"]
    assert turn.done.returncode == 0, turn.done.stderr
    assert "Both tools ran." in turn.done.stdout
    assert (stack.work / "shell.txt").read_text() == "shell-ok\n"
    assert (stack.work / "hello.txt").read_text() == "hello from kiln\n"
    call, answer = turn.upstream
    patch_tool = next(t["function"] for t in call["tools"] if t["function"]["name"] == "apply_patch")
    assert patch_tool["parameters"]["required"] == ["input"]  # Codex's freeform tool, as a one-string function
    calling, *results = answer["messages"][-3:]
    assert [c["function"]["name"] for c in calling["tool_calls"]] == ["exec_command", "apply_patch"]
    assert json.loads(calling["tool_calls"][1]["function"]["arguments"]) == {"input": PATCH}
    assert [r["tool_call_id"] for r in results] == [c["id"] for c in calling["tool_calls"]]
    assert "Success" in results[1]["content"]


def test_the_resumed_turn_sends_reasoning_back_and_the_gateway_restores_it(stack: Stack) -> None:
    turn = stack.turns["resume"]
    assert turn.done.returncode == 0, turn.done.stderr
    assert "Resumed." in turn.done.stdout
    [resumed] = turn.upstream
    assistants = [m for m in resumed["messages"] if m["role"] == "assistant"]
    calling = next(m for m in assistants if m.get("tool_calls"))
    assert calling["reasoning"] == calling["reasoning_content"] == THOUGHT
    assert all(m.get("reasoning") for m in assistants), "every earlier answer had reasoning; all of it came back"


def test_the_ledger_shows_every_request_codex_made(stack: Stack) -> None:
    served = [body for turn in stack.turns.values() for body in turn.upstream]
    events = stack.ledger()
    assert len(events) == len(served) == 4
    assert {(e["endpoint"], e["model"], e["status"]) for e in events} == {("responses", MODEL, "ok")}
    assert all(e["prompt_tokens"] > 1000 and e["completion_tokens"] > 0 and e["cost_nano"] > 0 for e in events)
    assert all(e["reasoning_tokens"] > 0 for e in events)

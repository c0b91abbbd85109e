"""Fixtures of the real-server suite: llama.cpp's llama-server with SmolLM2-135M, and Kiln in front of it.

One llama-server (2 slots, `--jinja`) and one gateway serve the session; every
test gets its own organisation and key (the root conftest's `tenant`, here on
this gateway). Building the server or fetching the model happens once per
machine (see llama.py) and its time is printed; if either fails, every test
here fails with the reason: nothing is skipped.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import Gateway, free_port, start_gateway, stop, wait_for
from real.llama import LlamaServer, PrepareError, prepare

MODEL = "smollm2"
SLOTS = 2
CTX_PER_SLOT = 512  # small, so that overflow tests tokenize and process few tokens on 2 cores
# USD per 1M tokens: input, cached input, output (distinct, so a wrong class of token shows in the cost).
PRICES = ("0.50", "0.25", "1.50")
_NOTES: list[str] = []


def catalog(llama_url: str, context_window: int) -> str:
    """The Kiln catalog in front of the server, with only what exists today: a model with url/model backends.

    Capabilities are what this server and model do (tests/real/NOTES.md): SmolLM2's template renders
    no tools, so llama-server drops tools silently; response_format and json_schema are enforced
    by its grammar sampler.
    """
    p_in, p_cached, p_out = PRICES
    return f"""
[server]
keepalive_s = 1
backend_retry_s = 1

[limits]
rpm = 100000
concurrency = 64

[[models]]
id = "{MODEL}"
family = "smollm2"
context_window = {context_window}
max_output_tokens = {context_window}
prices = {{ input = "{p_in}", cached_input = "{p_cached}", output = "{p_out}" }}
capabilities = {{ tool_choice = ["auto", "none"], response_format = true }}
[[models.backends]]
url = "{llama_url}/v1"
model = "{MODEL}"
"""


@pytest.fixture(scope="session")
def llama(request: pytest.FixtureRequest) -> Iterator[LlamaServer]:
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(f"kiln-real: {line}")
        else:
            print(f"kiln-real: {line}", file=sys.stderr)

    logs = Path(tempfile.mkdtemp(prefix="kiln-real-"))
    problem = None
    try:
        prepared = prepare(say)
        _NOTES.extend(prepared.notes)
        server = LlamaServer.start(prepared, free_port(), SLOTS, CTX_PER_SLOT, MODEL, logs / "llama-server.log")
    except PrepareError as exc:
        problem = str(exc)
    if problem is not None:
        pytest.fail(f"the real llama.cpp server is not available: {problem}", pytrace=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gateway(llama: LlamaServer) -> Iterator[Gateway]:
    """Kiln in front of llama-server; overrides the root conftest's simulator gateway for this directory."""
    n_ctx = llama.props()["default_generation_settings"]["n_ctx"]
    assert n_ctx == CTX_PER_SLOT, n_ctx
    gw = start_gateway(catalog(llama.url, n_ctx))
    yield gw
    stop(gw.proc)


@pytest.fixture(autouse=True)
def _idle(llama: LlamaServer) -> Iterator[None]:
    """Each test starts with both slots idle (a cut request of the previous test may still be stopping)."""

    wait_for(lambda: llama.busy() == 0, timeout=60, what="llama-server's slots to be idle")
    yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _NOTES:
        terminalreporter.write_sep("-", "kiln-real: llama-server and model")
        for line in _NOTES:
            terminalreporter.write_line(line)

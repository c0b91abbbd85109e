"""Fixtures of the reliability suite: the adversarial backend, a gateway in front of it
with short time limits, the soak switch, and the report of what was observed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from conftest import Gateway, start_gateway, stop
from reliability.harness import OBSERVATIONS

HERE = Path(__file__).parent
REQUEST_TIMEOUT_S = 3  # the gateway's overall deadline in the fault tests
MAX_BODY_BYTES = 16 * 1024 * 1024  # the largest JSON answer the gateway takes from a backend here
ADV_MODEL = "adv"



def soak_enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--soak", default=False)) or os.environ.get("KILN_SOAK") == "1"


@pytest.fixture(scope="session")
def soak(request: pytest.FixtureRequest) -> bool:
    return soak_enabled(request.config)


class Backend:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "backend.py"), "--port", "0"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.url = line.rsplit(" ", 1)[-1].strip()

    def requests(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/adv/requests", timeout=10).json()


@pytest.fixture(scope="session")
def adv() -> Iterator[Backend]:
    backend = Backend()
    yield backend
    stop(backend.proc)  # type: ignore[arg-type]


def adv_toml(url: str, extra_server: str = "") -> str:
    return f"""
[server]
keepalive_s = 0.5
backend_retry_s = 1
max_upstream_body_bytes = {MAX_BODY_BYTES}
request_timeout_s = {REQUEST_TIMEOUT_S}
{extra_server}

[limits]
rpm = 100000
concurrency = 64

[[models]]
id = "{ADV_MODEL}"
context_window = 32768
max_output_tokens = 4096
prices = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
[[models.backends]]
url = "{url}/v1"
kind = "vllm"  # what it imitates: its JSON faults reach the gateway as JSON (no stream for JSON clients)
"""


@pytest.fixture(scope="session")
def adv_gateway(adv: Backend) -> Iterator[Gateway]:
    gw = start_gateway(adv_toml(adv.url))
    yield gw
    stop(gw.proc)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not OBSERVATIONS:
        return
    terminalreporter.section("reliability observations")
    for obs in OBSERVATIONS:
        terminalreporter.write_line(json.dumps(obs, default=str)[:600])
    path = os.environ.get("KILN_RELIABILITY_LOG")
    if path:
        with open(path, "a") as f:
            for obs in OBSERVATIONS:
                f.write(json.dumps(obs, default=str) + "\n")

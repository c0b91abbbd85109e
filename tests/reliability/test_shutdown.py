"""Shutdown with streams in flight: SIGTERM, and a double Ctrl-C, bill every stream.

Streams of the four protocols run against the simulator, some short enough to finish
within the grace period, most far longer. On SIGTERM the gateway stops accepting,
lets the short ones finish, cuts the rest when `shutdown_grace_s` ends and bills each
for what it delivered before the ledger stops. A second Ctrl-C cuts at once, with the
same billing. The books are read after a restart on the same data directory.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from decimal import Decimal
from typing import Any, Iterator

import httpx
import pytest

from conftest import QWEN_UPSTREAM, Sim, Tenant, catalog_toml, start_gateway, start_sim, stop, wait_for
from reliability.harness import Answer, body_for, observe, send

GRACE_S = 4
LONG = {"reply_tokens": 3000, "token_delay_ms": 20}  # a minute
SHORT = {"reply_tokens": 100, "token_delay_ms": 20}  # two seconds: finishes within the grace
PROTOCOLS = ("chat", "completions", "responses", "messages")


@pytest.fixture(scope="module")
def slow_sim() -> Iterator[tuple[Sim, str, str]]:
    """A simulator where prompts with LONG stream for a minute and SHORT for about a second."""
    sim = start_sim("--model", QWEN_UPSTREAM, "--model", "gpt-oss-120b")
    long_tag, short_tag = "long" + uuid.uuid4().hex[:8], "short" + uuid.uuid4().hex[:8]
    sim.configure(rules=[{"when": long_tag, "sim": LONG}, {"when": short_tag, "sim": SHORT}])
    yield sim, long_tag, short_tag
    stop(sim.proc)


def _config(sim: Sim) -> str:
    return catalog_toml(sim.url).replace("[server]\n", f"[server]\nshutdown_grace_s = {GRACE_S}\n", 1)


def _stream_all(tenant: Tenant, prompts: list[tuple[str, str]]) -> tuple[list[Answer], list[threading.Thread]]:
    answers: list[Answer] = []
    lock = threading.Lock()

    def one(protocol: str, prompt: str) -> None:
        # Legacy completions has no chat turn for the simulator's rules: it carries the control itself.
        extra = {"sim": LONG if "long" in prompt else SHORT} if protocol == "completions" else {}
        answer = send(tenant, protocol, body_for(protocol, "qwen3-32b", prompt, True, 4000, **extra), timeout=90)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=one, args=p) for p in prompts]
    for th in threads:
        th.start()
    return answers, threads


def _shutdown_run(sim: Sim, long_tag: str, short_tag: str, signals: list[signal.Signals]) -> dict[str, Any]:
    gw = start_gateway(_config(sim))
    tenant = gw.new_key(credits="10")
    prompts = [(p, f"Tell a story {long_tag} {i}") for i, p in enumerate(PROTOCOLS * 3)]
    prompts += [(p, f"Short one {short_tag}") for p in PROTOCOLS]
    started_streams = time.monotonic()
    answers, threads = _stream_all(tenant, prompts)

    def all_running() -> bool:
        info = tenant.http().get("/v1/key").json()
        return info["rate_limits"]["in_flight"] == len(prompts)

    wait_for(all_running, timeout=30, what="every stream to start")
    time.sleep(0.5)  # some chunks out on every stream
    sent = time.monotonic()
    for sig in signals:
        gw.proc.send_signal(sig)
        time.sleep(0.3)
    try:
        gw.proc.wait(GRACE_S + 30)
    except Exception:
        gw.proc.kill()
        raise
    exit_s = time.monotonic() - sent
    for th in threads:
        th.join(30)
    restarted = start_gateway(_config(sim), data_dir=gw.data_dir)
    try:
        t = Tenant(restarted, tenant.org_id, tenant.project_id, tenant.key_id, tenant.key)
        events = {e["id"]: e for e in t.usage()}
        org = t.org()
    finally:
        stop(restarted.proc)
    return {"answers": answers, "events": events, "org": org, "exit_s": exit_s, "streams": len(prompts),
            "log": (gw.data_dir / "gateway.log").read_text()[-3000:], "started": started_streams}


def _check_every_stream_billed(run: dict[str, Any], name: str) -> None:
    answers: list[Answer] = run["answers"]
    events: dict[str, dict[str, Any]] = run["events"]
    org = run["org"]
    rows = []
    for a in answers:
        e = events.get(a.generation_id or "")
        rows.append({"protocol": a.protocol, "ending": a.ending, "delivered": a.delivered_tokens(),
                     "event_completion_tokens": e and e["completion_tokens"], "cost": e and e["cost"],
                     "status": e and e["status"], "client_failure": a.failure or None})
    observe(name, streams=run["streams"], exit_seconds=round(run["exit_s"], 2),
            events=len(events), total_spend=org["total_spend"], credits=org["credits"],
            granted=org["total_granted"], streams_detail=rows)
    assert all(a.status == 200 and a.generation_id for a in answers), [a.summary() for a in answers]
    assert len(answers) == run["streams"]
    missing = [r for a, r in zip(answers, rows) if a.generation_id not in events]
    assert not missing, (f"{len(missing)} of {len(answers)} streams have no usage event", missing, run["log"])
    assert len(events) == len(answers), events
    for a, r in zip(answers, rows):
        assert r["event_completion_tokens"] >= r["delivered"] > 0, r
    costs = sum((Decimal(e["cost"]) for e in events.values()), Decimal(0))
    assert Decimal(org["total_spend"]) == costs
    assert Decimal(org["credits"]) == Decimal(org["total_granted"]) - costs


@pytest.fixture(scope="module")
def sigterm_run(slow_sim: tuple[Sim, str, str]) -> dict[str, Any]:
    return _shutdown_run(*slow_sim, [signal.SIGTERM])


@pytest.fixture(scope="module")
def double_sigint_run(slow_sim: tuple[Sim, str, str]) -> dict[str, Any]:
    return _shutdown_run(*slow_sim, [signal.SIGINT, signal.SIGINT])


def test_sigterm_finishes_short_streams_and_bills_the_cut_ones(sigterm_run: dict[str, Any]) -> None:
    _check_every_stream_billed(sigterm_run, "shutdown:SIGTERM")
    endings = [a.ending for a in sigterm_run["answers"]]
    assert endings.count("complete") >= len(PROTOCOLS), endings  # the short ones finished within the grace
    assert sigterm_run["exit_s"] < GRACE_S + 15, sigterm_run["exit_s"]


def test_double_ctrl_c_cuts_at_once_and_bills_every_stream(double_sigint_run: dict[str, Any]) -> None:
    _check_every_stream_billed(double_sigint_run, "shutdown:double SIGINT")
    assert double_sigint_run["exit_s"] < GRACE_S + 10, double_sigint_run["exit_s"]


@pytest.mark.parametrize("which", ["sigterm_run", "double_sigint_run"])
def test_cut_streams_are_billed_exactly_the_tokens_delivered(which: str, request: pytest.FixtureRequest) -> None:
    """Issue 9 item 3: an estimate from chunks must not count the role chunk as a token."""
    run = request.getfixturevalue(which)
    wrong = []
    for a in run["answers"]:
        e = run["events"].get(a.generation_id or "")
        if e is not None and a.ending != "complete" and e["completion_tokens"] != a.delivered_tokens():
            wrong.append((a.protocol, a.delivered_tokens(), e["completion_tokens"]))
    assert not wrong, f"(protocol, tokens delivered, tokens billed): {wrong}"


def test_no_new_connections_after_sigterm(slow_sim: tuple[Sim, str, str]) -> None:
    """During the grace period the listening socket is closed: new clients are refused at once."""
    sim, long_tag, _ = slow_sim
    gw = start_gateway(_config(sim))
    tenant = gw.new_key(credits="10")
    answers, threads = _stream_all(tenant, [("chat", f"story {long_tag}")])
    wait_for(lambda: tenant.http().get("/v1/key").json()["rate_limits"]["in_flight"] == 1, timeout=20)
    gw.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(gw.url + "/health", timeout=2)
    gw.proc.wait(GRACE_S + 20)
    for th in threads:
        th.join(30)

"""Routing over several backends of one model: balance, limits, health, failover, affinity.

Every test runs real simulators (`kiln sim --id NAME`) behind one real gateway
whose catalog lists them as backends of the model `pool`. Which replica served
a request is read from the simulators' own stats. Faults are real: a killed
process, a stopped one (SIGSTOP: it accepts connections and never answers),
a simulator told to answer 503.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx

from conftest import ADMIN_KEY, Gateway, Sim, Tenant, free_port, start_gateway, start_sim, stop, wait_for

MODEL = "pool"
UPSTREAM = "demo-model"


@dataclass
class Cluster:
    gw: Gateway
    sims: dict[str, Sim]
    tenant: Tenant

    def totals(self) -> dict[str, int]:
        return {name: s.stats()["total"] for name, s in self.sims.items()}

    def reset(self) -> None:
        for s in self.sims.values():
            s.reset()

    def backends(self) -> dict[str, dict[str, Any]]:
        """GET /admin/v1/backends by simulator name."""
        rows = self.gw.admin.get("/backends").json()["data"]
        by_url = {s.url + "/v1": name for name, s in self.sims.items()}
        return {by_url[r["url"]]: r for r in rows if r["url"] in by_url}

    def chat(self, content: str = "Hello!", timeout: float = 60, **body: Any) -> httpx.Response:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **body}
        with self.tenant.http() as client:
            return client.post("/v1/chat/completions", json=payload, timeout=timeout)

    def stream(self, content: str = "Hello!", **body: Any) -> tuple[int, list[Any]]:
        """A streamed chat: (status, data payloads)."""
        payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
                   "stream": True, **body}
        with self.tenant.http() as client, client.stream("POST", "/v1/chat/completions", json=payload,
                                                          timeout=60) as r:
            raw = r.read().decode()
        payloads = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
        return r.status_code, [p if p == "[DONE]" else json.loads(p) for p in payloads]


def cluster_toml(sims: dict[str, Sim], routing: str = "", backend: dict[str, str] | None = None,
                 keepalive_s: float = 0.5) -> str:
    backends = "".join(
        f'\n[[models.backends]]\nurl = "{s.url}/v1"\nmodel = "{UPSTREAM}"\n{(backend or {}).get(name, "")}\n'
        for name, s in sims.items()
    )
    return f"""
[server]
keepalive_s = {keepalive_s}
backend_retry_s = 0.5

[limits]
rpm = 1000000
concurrency = 256

[routing]
{routing}

[[models]]
id = "{MODEL}"
context_window = 32768
max_output_tokens = 1024
prices = {{ input = "1", output = "2" }}
{backends}
"""


@contextlib.contextmanager
def cluster(names: str, sim_args: dict[str, list[str]] | None = None, routing: str = "",
            backend: dict[str, str] | None = None, keepalive_s: float = 0.5) -> Iterator[Cluster]:
    """Simulators named by the letters of `names`, behind one gateway; everything stopped after."""
    sims: dict[str, Sim] = {}
    gw: Gateway | None = None
    try:
        for name in names:
            sims[name] = start_sim("--id", name, *(sim_args or {}).get(name, []))
        gw = start_gateway(cluster_toml(sims, routing, backend, keepalive_s))
        yield Cluster(gw, sims, gw.new_key(credits="1000"))
    finally:
        if gw is not None:
            stop(gw.proc)
        for s in sims.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.proc.pid, signal.SIGCONT)
            stop(s.proc)


def run_concurrently(n: int, job: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(job, range(n)))


def in_flight_at_least(sim: Sim, n: int) -> Callable[[], bool]:
    return lambda: sim.stats()["in_flight"] >= n


# -- balancing ----------------------------------------------------------------------------------


def test_load_follows_requests_in_flight() -> None:
    """A slow replica holds its requests longer, so the fast one takes most of the traffic."""
    with cluster("ab", {"a": ["--ttft-ms", "1500"]}, routing="affinity = false") as c:
        c.reset()
        results = run_concurrently(8, lambda i: [c.chat(f"load {i} {k}").status_code for k in range(6)])
        assert all(code == 200 for codes in results for code in codes)
        totals = c.totals()
        assert sum(totals.values()) == 48
        assert totals["b"] > 2 * totals["a"], totals


def test_load_follows_weights() -> None:
    """Equal replicas with weights 1 and 3 get about a quarter and three quarters of concurrent traffic."""
    with cluster("ab", {n: ["--ttft-ms", "1000"] for n in "ab"}, routing="affinity = false",
                 backend={"b": "weight = 3"}) as c:
        c.reset()
        results = run_concurrently(12, lambda i: [c.chat(f"weight {i} {k}").status_code for k in range(4)])
        assert all(code == 200 for codes in results for code in codes)
        totals = c.totals()
        assert 2.0 <= totals["b"] / max(totals["a"], 1) <= 5.0, totals
        assert c.sims["b"].stats()["max_in_flight"] > c.sims["a"].stats()["max_in_flight"]


def test_max_in_flight_per_backend_holds() -> None:
    with cluster("ab", {n: ["--ttft-ms", "300"] for n in "ab"}, routing="queue_timeout_s = 60",
                 backend={n: "max_in_flight = 2" for n in "ab"}) as c:
        c.reset()
        codes = run_concurrently(10, lambda i: c.chat(f"cap {i}").status_code)
        assert codes == [200] * 10
        for name, s in c.sims.items():
            assert s.stats()["max_in_flight"] <= 2, name
        assert sum(c.totals().values()) == 10


def test_beyond_max_in_flight_a_request_waits_then_gets_503_in_its_protocol() -> None:
    with cluster("a", {"a": ["--ttft-ms", "3000"]}, routing="queue_timeout_s = 0.5",
                 backend={"a": "max_in_flight = 1"}) as c:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(c.chat, "occupy the only slot")
            wait_for(in_flight_at_least(c.sims["a"], 1), 20, "the first request to reach the backend")
            started = time.monotonic()
            r = c.chat("no room")
            waited = time.monotonic() - started
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "service_unavailable"
            assert int(r.headers["retry-after"]) >= 1
            assert waited >= 0.45
            with c.tenant.http() as client:
                m = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                      "messages": [{"role": "user", "content": "no room"}]})
            assert m.status_code == 503, m.text
            assert m.json()["type"] == "error" and m.json()["error"]["type"] == "overloaded_error"
            assert "retry-after" in m.headers
            assert running.result().status_code == 200
        assert c.sims["a"].stats()["max_in_flight"] == 1
        events = c.tenant.usage()  # the refused ones recorded at no cost (a failure that was not theirs)
        assert sorted((e["status"], e["cost"] == "0") for e in events) == [("error", True), ("error", True),
                                                                          ("ok", False)]
        assert {e["id"] for e in events} >= {r.headers["x-neocloud-generation-id"],
                                             m.headers["x-neocloud-generation-id"]}


# -- failover -----------------------------------------------------------------------------------


def _kill_under_load(c: Cluster, wait_s: float) -> tuple[int, list[tuple[int, list[Any]]]]:
    """Six streams and twelve JSON requests in flight on three replicas (2 s to the first token),
    replica c killed `wait_s` after they all arrived, six more JSON requests after it: every JSON
    request succeeds. Returns how many streams c held and the streams' outcomes."""
    victim = c.sims["c"]
    with ThreadPoolExecutor(24) as pool:
        streams = [pool.submit(c.stream, f"stream {i}") for i in range(6)]
        wait_for(lambda: sum(s.stats()["in_flight"] for s in c.sims.values()) >= 6, 20, "streams in flight")
        plain = [pool.submit(c.chat, f"json {i}") for i in range(12)]
        wait_for(lambda: sum(s.stats()["in_flight"] for s in c.sims.values()) >= 18, 20, "all in flight")
        time.sleep(wait_s)
        on_victim = [e["body"] for e in victim.requests()]
        victim_streams = sum(1 for b in on_victim if b.get("stream"))
        assert victim_streams >= 1 and len(on_victim) > victim_streams, "the victim must hold both kinds"
        victim.proc.kill()
        victim.proc.wait()
        late = [pool.submit(c.chat, f"late {i}") for i in range(6)]
        assert [f.result().status_code for f in plain + late] == [200] * 18
        outcomes = [f.result() for f in streams]
    assert all(status == 200 for status, _ in outcomes)
    assert wait_for(lambda: c.backends()["c"]["state"] == "down", 10, "the victim to be down")
    return victim_streams, outcomes


def _errors(payloads: list[Any]) -> bool:
    return any(isinstance(x, dict) and "error" in x for x in payloads)


def test_killed_backend_loses_no_request_that_had_not_started_streaming() -> None:
    """Three replicas under load, one killed: every JSON request succeeds, and so does every stream
    that had received nothing yet (no output, no keepalive: its 200 had not gone out), those on the
    victim included: they move to another replica."""
    with cluster("abc", {n: ["--ttft-ms", "2000"] for n in "abc"}, routing="affinity = false",
                 keepalive_s=30) as c:
        victim_streams, outcomes = _kill_under_load(c, wait_s=0)
        assert victim_streams >= 1
        for _, payloads in outcomes:
            assert payloads and payloads[-1] == "[DONE]" and not _errors(payloads), payloads
        events = [e for e in c.tenant.usage() if e["streamed"]]
        assert len(events) == 6 and all(e["status"] == "ok" for e in events)
        assert not any(c.sims["c"].url.split("//")[1] in (e["backend"] or "") for e in events), \
            "the streams the victim held were served by another replica"
        assert "before its first output" in c.gw.log.read_text()


def test_a_stream_whose_200_went_out_ends_with_an_error_when_its_backend_dies() -> None:
    """Once a stream's 200 has gone out (here with its keepalives, 0.5 s apart), a failure of its
    backend ends it with an in-stream error event, never a clean end; the other streams complete."""
    with cluster("abc", {n: ["--ttft-ms", "2000"] for n in "abc"}, routing="affinity = false") as c:
        victim_streams, outcomes = _kill_under_load(c, wait_s=1.0)
        broken = [p for _, p in outcomes if _errors(p)]
        complete = [p for _, p in outcomes if p and p[-1] == "[DONE]" and not _errors(p)]
        assert len(broken) == victim_streams, (len(broken), victim_streams)
        assert len(complete) == 6 - victim_streams


def test_503_fails_over_and_ejects_the_backend_until_it_recovers() -> None:
    routing = "affinity = false\neject_after = 3\nejection_s = 3\nmax_ejection_s = 60"
    with cluster("ab", routing=routing) as c:
        a = c.sims["a"]
        a.configure(rules=[{"when": "MARKER", "sim": {"status": 503}}])
        for i in range(40):  # each lands on a with p=1/2; its third failure ejects it
            r = c.chat(f"MARKER {i}")
            assert r.status_code == 200, r.text  # failed over to b
            if c.backends()["a"]["state"] == "ejected":
                break
        state = c.backends()["a"]
        assert state["state"] == "ejected", state
        assert "HTTP 503" in state["last_error"] and state["ejections"] == 1
        a.reset()
        for i in range(4):
            assert c.chat(f"MARKER ejected {i}").status_code == 200
        assert a.stats()["total"] == 0, "an ejected backend gets no traffic while others are healthy"
        a.configure(rules=[])
        wait_for(lambda: c.backends()["a"]["state"] == "healthy", 20, "re-admission after the ejection")
        wait_for(lambda: c.chat("MARKER back").status_code == 200 and a.stats()["total"] > 0, 20,
                 "traffic on the re-admitted backend")
        # Failing again right away: ejected again, for twice as long.
        a.configure(rules=[{"when": "MARKER", "sim": {"status": 503}}])
        wait_for(lambda: c.chat("MARKER again").status_code == 200 and c.backends()["a"]["state"] == "ejected",
                 30, "the second ejection")
        state = c.backends()["a"]
        assert state["ejections"] == 2 and state["ejected_for_s"] > 3.5, state


def test_hanging_backend_is_taken_down_its_requests_fail_over_and_it_comes_back() -> None:
    """SIGSTOP: the replica accepts connections and answers nothing. A stream waits for headers
    at most headers_timeout_s; a JSON request is moved once the health checks give up on it."""
    with cluster("ab", routing="affinity = false\nheaders_timeout_s = 2") as c:
        a = c.sims["a"]
        os.kill(a.proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            plain = [pool.submit(c.chat, f"json {i}") for i in range(4)]
            streams = [pool.submit(c.stream, f"stream {i}") for i in range(4)]
            assert [f.result().status_code for f in plain] == [200] * 4
            for f in streams:
                status, payloads = f.result()
                assert status == 200 and payloads[-1] == "[DONE]", payloads
        assert time.monotonic() - started < 30
        wait_for(lambda: c.backends()["a"]["state"] == "down", 20, "the hanging backend to be taken down")
        assert "health check" in (c.backends()["a"]["last_error"] or "")
        os.kill(a.proc.pid, signal.SIGCONT)
        wait_for(lambda: c.backends()["a"]["state"] == "healthy", 20, "the backend to come back")
        a.reset()
        wait_for(lambda: c.chat("after").status_code == 200 and a.stats()["total"] > 0, 20, "traffic on a again")


def test_failover_only_before_the_answer_and_never_on_a_4xx() -> None:
    with cluster("abc", routing="affinity = false\nretries = 2\neject_after = 100") as c:
        for s in c.sims.values():
            s.configure(rules=[{"when": "BUSY", "sim": {"status": 503}},
                               {"when": "REJECT", "sim": {"status": 400, "error_message": "bad top_k"}},
                               {"when": "CRASH", "sim": {"status": 500}}])
        c.reset()
        r = c.chat("BUSY everywhere")
        assert r.status_code == 503, r.text
        assert sum(c.totals().values()) == 3, "one try and two retries"
        c.reset()
        r = c.chat("REJECT")
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad top_k"
        assert sum(c.totals().values()) == 1, "a 4xx is the answer: no other backend is asked"
        c.reset()
        r = c.chat("CRASH")
        assert r.status_code == 502
        assert sum(c.totals().values()) == 1, "a 500 is not retried: the request may be what crashes it"
        assert [e["cost"] for e in c.tenant.usage()] == ["0", "0"]  # the 503 and the 502, recorded at no cost


# -- affinity -----------------------------------------------------------------------------------


def test_affinity_keeps_a_session_on_one_backend_and_spills_over_under_load() -> None:
    with cluster("abc", routing="affinity_balance = 0.25") as c:
        def served(send: Callable[[], httpx.Response], n: int) -> dict[str, int]:
            c.reset()
            for _ in range(n):
                r = send()
                assert r.status_code == 200, r.text
            return {k: v for k, v in c.totals().items() if v}

        key = str(uuid.uuid4())
        codex = served(lambda: c.tenant.http().post("/v1/responses", json={
            "model": MODEL, "input": f"turn {uuid.uuid4()}", "prompt_cache_key": key, "max_output_tokens": 8}), 6)
        assert list(codex.values()) == [6], codex
        user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": str(uuid.uuid4())})
        claude = served(lambda: c.tenant.http().post("/v1/messages", json={
            "model": MODEL, "max_tokens": 8, "metadata": {"user_id": user_id},
            "messages": [{"role": "user", "content": f"turn {uuid.uuid4()}"}]}), 6)
        assert list(claude.values()) == [6], claude
        sessions = served(lambda: c.chat("x", prompt_cache_key=str(uuid.uuid4())), 30)
        assert len(sessions) == 3, f"different sessions spread over the replicas: {sessions}"

        # One hot session, nine requests at once: the owner takes its bounded share, the rest spill.
        for s in c.sims.values():
            s.configure(ttft_ms=1500)
        c.reset()
        hot = str(uuid.uuid4())
        codes = run_concurrently(9, lambda i: c.chat(f"hot {i}", prompt_cache_key=hot).status_code)
        assert codes == [200] * 9
        peaks = {name: s.stats()["max_in_flight"] for name, s in c.sims.items()}
        totals = c.totals()
        owner = max(totals, key=lambda n: totals[n])
        assert len([n for n in totals if totals[n]]) >= 2, totals
        assert peaks[owner] <= 4, peaks  # ceil((1 + 0.25) × 9 / 3)


def test_round_robin_without_affinity_moves_a_session_around() -> None:
    with cluster("abc", routing="affinity = false") as c:
        c.reset()
        key = str(uuid.uuid4())
        for i in range(12):
            assert c.chat(f"turn {i}", prompt_cache_key=key).status_code == 200
        assert len([v for v in c.totals().values() if v]) >= 2


# -- visibility ---------------------------------------------------------------------------------


def test_models_list_hides_a_model_whose_backends_are_all_down() -> None:
    ports = [free_port(), free_port()]
    with cluster("ab", {"a": ["--port", str(ports[0])], "b": ["--port", str(ports[1])]}) as c:
        def listed() -> bool:
            return MODEL in {m["id"] for m in c.tenant.http().get("/v1/models").json()["data"]}

        assert listed()
        stop(c.sims["a"].proc)
        wait_for(lambda: c.backends()["a"]["state"] == "down", 20, "a down")
        assert listed(), "one backend is still up"
        assert c.chat().status_code == 200
        stop(c.sims["b"].proc)
        wait_for(lambda: not listed(), 20, "the model to leave the list")
        r = c.chat()
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        c.sims["a"] = start_sim("--id", "a", "--port", str(ports[0]))
        wait_for(listed, 20, "the model to come back with one backend")
        assert c.chat().status_code == 200


def test_admin_endpoint_and_cli_show_each_backend() -> None:
    with cluster("ab", {"a": ["--ttft-ms", "1500"]}, routing="affinity = false") as c:
        assert httpx.get(c.gw.url + "/admin/v1/backends").status_code == 401
        assert c.chat().status_code == 200
        stop(c.sims["b"].proc)
        wait_for(lambda: c.backends()["b"]["state"] == "down", 20, "b down")
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(c.chat, "slow")
            wait_for(lambda: c.backends()["a"]["in_flight"] == 1, 20, "a request in flight on a")
            out = subprocess.run(
                [sys.executable, "-m", "kiln", "admin", "--url", c.gw.url, "backends"],
                env={**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY}, capture_output=True, text=True, timeout=60)
            assert slow.result().status_code == 200
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:4] == ["MODEL", "URL", "STATE", "IN"]
        row_a = next(line for line in lines if c.sims["a"].url in line)
        row_b = next(line for line in lines if c.sims["b"].url in line)
        assert " healthy " in row_a and " 1/1024 " in row_a
        assert " down " in row_b and "unreachable" in row_b
        state = c.backends()
        assert state["a"]["state"] == "healthy" and state["a"]["in_flight"] == 0
        assert state["a"]["latency_ms"] is not None and state["a"]["requests"] >= 1
        assert state["b"]["state"] == "down" and "unreachable" in state["b"]["last_error"]
        assert state["a"]["upstream_model"] == UPSTREAM and state["a"]["weight"] == 1
        raw = subprocess.run(
            [sys.executable, "-m", "kiln", "admin", "--url", c.gw.url, "backends", "--json"],
            env={**os.environ, "KILN_ADMIN_KEY": ADMIN_KEY}, capture_output=True, text=True, timeout=60)
        assert {r["state"] for r in json.loads(raw.stdout)["data"]} == {"healthy", "down"}

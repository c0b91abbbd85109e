"""What the reliability tests share: one request in any of the four protocols, what the
client saw (status, bytes, time, how the stream ended), and the checks that money and
slots came back: one event per answered request, credits = grants - events, nothing
reserved or in flight once everything is done.

Every test records an observation (`observe`); the session prints them at the end and
writes them as JSON lines to $KILN_RELIABILITY_LOG when it is set.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

import httpx

from conftest import Tenant, wait_for

OBSERVATIONS: list[dict[str, Any]] = []

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def body_for(protocol: str, model: str, prompt: str, stream: bool, max_tokens: int = 64,
             **extra: Any) -> dict[str, Any]:
    if protocol == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    elif protocol == "completions":
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    elif protocol == "responses":
        body = {"model": model, "input": prompt, "max_output_tokens": max_tokens}
    else:
        body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "stream": stream, **extra}


@dataclass
class Answer:
    """What the client saw."""

    protocol: str
    stream: bool
    status: int
    headers: dict[str, str]
    raw: bytes
    seconds: float
    failure: str = ""  # transport failure on the client's side (read timeout, reset), if any

    @property
    def generation_id(self) -> str | None:
        return self.headers.get("x-neocloud-generation-id")

    @property
    def events(self) -> list[tuple[str, Any]]:
        """SSE events as (event name or "", parsed data or the raw text); comments skipped."""
        out: list[tuple[str, Any]] = []
        for frame in self.raw.decode("utf-8", "replace").replace("\r\n", "\n").split("\n\n"):
            name, data = "", []
            for line in frame.split("\n"):
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))
            if not data:
                continue
            text = "\n".join(data)
            try:
                out.append((name, json.loads(text, parse_float=Decimal)))
            except ValueError:
                out.append((name, text))
        return out

    @property
    def ending(self) -> str:
        """How a stream ended: "complete", "error" (a protocol error event) or "cut" (neither)."""
        events = self.events
        for name, data in events:
            if _is_error_event(self.protocol, name, data):
                return "error"
        if self.protocol in ("chat", "completions"):
            return "complete" if events and events[-1][1] == "[DONE]" else "cut"
        final = {"responses": "response.completed", "messages": "message_stop"}[self.protocol]
        return "complete" if any(name == final for name, _ in events) else "cut"

    def delivered_tokens(self) -> int:
        """Content pieces the client received (the backends here send one token per piece)."""
        n = 0
        for name, data in self.events:
            if not isinstance(data, dict):
                continue
            if self.protocol == "chat":
                n += sum(1 for c in data.get("choices") or [] if (c.get("delta") or {}).get("content"))
            elif self.protocol == "completions":
                n += sum(1 for c in data.get("choices") or [] if c.get("text"))
            elif self.protocol == "responses":
                n += name == "response.output_text.delta" and bool(data.get("delta"))
            else:
                n += name == "content_block_delta" and bool((data.get("delta") or {}).get("text"))
        return n

    def json(self) -> Any:
        return json.loads(self.raw, parse_float=Decimal)

    def summary(self) -> dict[str, Any]:
        return {"status": self.status, "bytes": len(self.raw), "seconds": round(self.seconds, 2),
                "ending": self.ending if self.stream and self.status == 200 else None,
                "generation_id": self.generation_id, "client_failure": self.failure or None,
                "head": self.raw[:160].decode("utf-8", "replace"), "tail": self.raw[-160:].decode("utf-8", "replace")}


def _is_error_event(protocol: str, name: str, data: Any) -> bool:
    if protocol in ("chat", "completions"):
        return isinstance(data, dict) and "error" in data
    if protocol == "responses":
        return name in ("error", "response.failed")
    return name == "error"


def send(tenant: Tenant, protocol: str, body: dict[str, Any], timeout: float = 30.0) -> Answer:
    """One request as a client would send it; a stream is read to its end (or the timeout)."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {tenant.key}"}
    if protocol == "messages":
        headers["anthropic-version"] = "2023-06-01"
    raw, status, resp_headers, failure = b"", 0, {}, ""
    with httpx.Client(base_url=tenant.gw.url, timeout=httpx.Timeout(timeout)) as client:
        try:
            with client.stream("POST", PATHS[protocol], json=body, headers=headers) as resp:
                status, resp_headers = resp.status_code, {k.lower(): v for k, v in resp.headers.items()}
                chunks = []
                try:
                    for piece in resp.iter_raw():
                        chunks.append(piece)
                        if time.monotonic() - started > timeout:
                            failure = "client gave up"
                            break
                except httpx.HTTPError as exc:
                    failure = type(exc).__name__
                raw = b"".join(chunks)
        except httpx.HTTPError as exc:
            failure = type(exc).__name__
    return Answer(protocol, bool(body.get("stream")), status, resp_headers, raw, time.monotonic() - started, failure)


def assert_protocol_error(answer: Answer, status: int | None = None) -> None:
    """A non-200 answer in the caller's protocol (OpenAI's 502 is plain text, per the contract)."""
    assert answer.status >= 400, answer.summary()
    if status is not None:
        assert answer.status == status, answer.summary()
    ctype = answer.headers.get("content-type", "")
    if answer.protocol != "messages" and answer.status == 502:
        assert ctype.startswith("text/plain"), answer.summary()
        return
    body = answer.json()
    if answer.protocol == "messages":
        assert body.get("type") == "error" and isinstance(body["error"].get("type"), str), body
        assert isinstance(body["error"].get("message"), str), body
    else:
        assert isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str), body


@dataclass
class Books:
    """A tenant's money after everything settled."""

    events: list[dict[str, Any]]
    credits: Decimal
    granted: Decimal
    total_spend: Decimal
    spendable: Decimal
    in_flight: int
    costs: Decimal = field(init=False)

    def __post_init__(self) -> None:
        self.costs = sum((Decimal(e["cost"]) for e in self.events), Decimal(0))


def settle(tenant: Tenant, events: int | None = None, timeout: float = 20.0) -> Books:
    """Wait until nothing is in flight (at most `timeout`), then up to 3 s more for `events`
    events, and read the books (a missing event shows in them, it does not hang the test)."""

    def idle() -> dict[str, Any] | None:
        info = tenant.http().get("/v1/key").json()
        return info if info["rate_limits"]["in_flight"] == 0 else None

    try:
        wait_for(idle, timeout=timeout, what="the tenant's requests to settle")
        if events is not None:
            wait_for(lambda: len(tenant.usage()) >= events, timeout=3, what="the usage events")
    except AssertionError:
        pass
    info = tenant.http().get("/v1/key").json()
    org = tenant.org()
    return Books(tenant.usage(), Decimal(org["credits"]), Decimal(org["total_granted"]),
                 Decimal(org["total_spend"]), Decimal(info["spendable"]), info["rate_limits"]["in_flight"])


def assert_nothing_leaked(books: Books) -> None:
    """Slot and reservation back; credits consumed = sum of events, never more than granted."""
    assert books.in_flight == 0, asdict(books)
    assert books.credits == books.granted - books.costs, asdict(books)
    assert books.total_spend == books.costs, asdict(books)
    assert books.spendable == books.credits, asdict(books)
    assert books.credits <= books.granted, asdict(books)


def observe(name: str, **fields: Any) -> None:
    OBSERVATIONS.append({"test": name, **fields})

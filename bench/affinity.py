"""Prefix-cache affinity benchmark: a multi-turn agent workload on 4 simulated replicas.

20 sessions × 10 turns, half Codex-like (POST /v1/responses with `prompt_cache_key`), half
Claude Code-like (POST /v1/messages with `metadata.user_id` and X-Claude-Code-Session-Id), all
streaming and all at once, each session sending its next turn as soon as the last one ended.
Every turn resends the whole conversation plus a new tool output, so prompts grow. The replicas
are `kiln sim` with prefix caching and a prefill cost per uncached prompt token
(`--prefill-us-per-token`), so a cache miss shows in the time to first token.

Three arms, each on fresh replicas (cold caches) behind a fresh gateway:
`[routing] affinity = true` and `affinity = false` (least requests in flight: where a turn lands
does not depend on its session, like round robin) on 4 replicas, and the ceiling: the same
workload on one replica, which sees every turn. Reported per arm: the cached-token ratio
(sum of cached / sum of prompt tokens, from the replicas' /sim/stats), the same from turn 2 on,
and the time to first token (client side, to the first text delta).

    .venv/bin/python bench/affinity.py [--sessions 20] [--turns 10] [--prefill-us-per-token 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from load import run_aiohttp
from measure import Bench, ledger_line
from servers import BenchError, Server, create_tenant, http, start_kiln, start_sim
from workloads import MODEL

REPLICAS = 4
WORDS = ("file", "function", "error", "test", "build", "module", "import", "return", "value", "config",
         "request", "stream", "token", "cache", "backend", "router", "session", "client", "server", "patch")


@dataclass
class Turn:
    session: int
    turn: int
    ttft_s: float
    prompt_tokens: int  # as the client was billed (usage of the response)
    cached_tokens: int


@dataclass
class Arm:
    name: str
    turns: list[Turn] = field(default_factory=list)
    replica_prompt_tokens: int = 0  # the same, counted by the replicas (/sim/stats)
    replica_cached_tokens: int = 0
    per_replica: list[int] = field(default_factory=list)  # requests each replica served
    seconds: float = 0.0
    ledger: str = ""  # the usage ledger's check

    def ratio(self, first_turn: bool = True) -> float:
        turns = [t for t in self.turns if first_turn or t.turn > 0]
        return sum(t.cached_tokens for t in turns) / sum(t.prompt_tokens for t in turns)

    def stayed(self) -> float:
        """Share of turns 2+ that found the whole previous turn's prompt cached (less its last block)."""
        prev = {(t.session, t.turn): t.prompt_tokens for t in self.turns}
        later = [t for t in self.turns if t.turn > 0]
        return sum(1 for t in later if t.cached_tokens >= prev[(t.session, t.turn - 1)] - 16) / len(later)


def text(rng: random.Random, tokens: int) -> str:
    """About `tokens` simulator tokens (one per word)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def start_replicas(stack: ExitStack, tmp: Path, n: int, prefill_us: float, token_delay_ms: float) -> list[Server]:
    """`kiln sim` replicas with prefix caching, a prefill cost per uncached token and 40-token replies."""
    return [start_sim(stack, tmp, None, name=f"sim{i}", reply_tokens=40,
                      extra=("--id", f"r{i}", "--prefill-us-per-token", str(prefill_us),
                             "--token-delay-ms", str(token_delay_ms))) for i in range(n)]


def start_gateway(stack: ExitStack, tmp: Path, urls: list[str], affinity: bool, balance: float) -> Server:
    routing = f"[routing]\naffinity = {'true' if affinity else 'false'}\naffinity_balance = {balance}\n"
    return start_kiln(stack, tmp, urls, None, extra_toml=routing)


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                 delta_event: str) -> tuple[float, str, int, int]:
    """POST a streaming request; (seconds to the first text delta, reply text, prompt tokens, cached tokens)."""
    started = time.monotonic()
    first: float | None = None
    reply: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise BenchError(f"{url}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
        event = ""
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
                continue
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if event == delta_event:
                piece = data["delta"] if isinstance(data["delta"], str) else data["delta"].get("text", "")
                if piece:
                    first = first or time.monotonic() - started
                    reply.append(piece)
            elif event == "response.completed":
                u = data["response"]["usage"]
                usage = {"prompt": u["input_tokens"], "cached": u["input_tokens_details"]["cached_tokens"]}
            elif event == "message_delta":
                u = data["usage"]
                cached = u["cache_read_input_tokens"]
                usage = {"prompt": u["input_tokens"] + cached, "cached": cached}
            elif event in ("error", "response.failed"):
                raise BenchError(f"{url}: stream error: {line}")
    if first is None or not usage:
        raise BenchError(f"{url}: no text or no usage in the reply")
    return first, "".join(reply), usage["prompt"], usage["cached"]


async def codex_session(http_: aiohttp.ClientSession, gw: str, key: str, n: int, args: argparse.Namespace,
                        shared: str, arm: Arm) -> None:
    rng = random.Random(1000 + n)
    cache_key = str(uuid.UUID(int=rng.getrandbits(128)))
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": text(rng, args.context_tokens)}]}]
    for t in range(args.turns):
        body = {"model": MODEL, "instructions": shared, "input": items, "stream": True, "store": False,
                "prompt_cache_key": cache_key, "max_output_tokens": 64}
        ttft, reply, prompt, cached = await stream(http_, gw + "/v1/responses", body,
                                                   {"Authorization": f"Bearer {key}"}, "response.output_text.delta")
        arm.turns.append(Turn(n, t, ttft, prompt, cached))
        items += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": reply}]},
                  {"type": "message", "role": "user", "content": [
                      {"type": "input_text", "text": "Tool output:\n" + text(rng, args.turn_tokens)}]}]


async def claude_session(http_: aiohttp.ClientSession, gw: str, key: str, n: int, args: argparse.Namespace,
                         shared: str, arm: Arm) -> None:
    rng = random.Random(2000 + n)
    session_id = str(uuid.UUID(int=rng.getrandbits(128)))
    user_id = json.dumps({"device_id": "0" * 64, "account_uuid": "", "session_id": session_id})
    messages: list[dict[str, Any]] = [{"role": "user", "content": text(rng, args.context_tokens)}]
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "X-Claude-Code-Session-Id": session_id}
    for t in range(args.turns):
        billing = f"x-anthropic-billing-header: cc_version=2.1.90; cch={rng.getrandbits(20):05x};"
        system = [{"type": "text", "text": billing},
                  {"type": "text", "text": shared, "cache_control": {"type": "ephemeral"}}]
        body = {"model": MODEL, "system": system, "messages": messages, "stream": True, "max_tokens": 64,
                "metadata": {"user_id": user_id}}
        ttft, reply, prompt, cached = await stream(http_, gw + "/v1/messages", body, headers, "content_block_delta")
        arm.turns.append(Turn(n, t, ttft, prompt, cached))
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": "Tool output:\n" + text(rng, args.turn_tokens)}]


async def drive(gw: str, key: str, args: argparse.Namespace, arm: Arm) -> None:
    rng = random.Random(7)
    codex_shared, claude_shared = text(rng, args.shared_tokens), text(rng, args.shared_tokens)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http_:
        jobs = [codex_session(http_, gw, key, n, args, codex_shared, arm) if n % 2 == 0
                else claude_session(http_, gw, key, n, args, claude_shared, arm) for n in range(args.sessions)]
        started = time.monotonic()
        await asyncio.gather(*jobs)
        arm.seconds = time.monotonic() - started


def sim_stats(url: str) -> dict[str, Any]:
    return json.loads(http("GET", url + "/sim/stats")[2])


def run_arm(args: argparse.Namespace, name: str, replicas: int, affinity: bool) -> Arm:
    """One arm on fresh replicas (cold caches) behind a fresh gateway; checks what was billed."""
    arm = Arm(name)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="kiln-affinity-") as tmp_name:
        tmp = Path(tmp_name)
        sims = start_replicas(stack, tmp, replicas, args.prefill_us_per_token, args.token_delay_ms)
        kiln = start_gateway(stack, tmp, [sim.url for sim in sims], affinity, args.affinity_balance)
        org_id, key = create_tenant(kiln)
        asyncio.run(drive(kiln.url, key, args, arm))
        stats = [sim_stats(sim.url) for sim in sims]
        arm.replica_prompt_tokens = sum(s["prompt_tokens"] for s in stats)
        arm.replica_cached_tokens = sum(s["cached_tokens"] for s in stats)
        arm.per_replica = [s["total"] for s in stats]
        if arm.replica_prompt_tokens != sum(t.prompt_tokens for t in arm.turns):
            raise BenchError("the replicas counted other prompt tokens than the clients were billed")
        if len(arm.turns) != args.sessions * args.turns:
            raise BenchError(f"{len(arm.turns)} turns completed, expected {args.sessions * args.turns}")
        b = Bench({"direct": sims[0], "kiln": kiln}, key, run_aiohttp, None, 0, 0, kiln_sent=len(arm.turns))
        arm.ledger = ledger_line(b, org_id, f" ({name})")
    return arm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--shared-tokens", type=int, default=2000,
                   help="instructions / system prompt shared by every session of one client")
    p.add_argument("--context-tokens", type=int, default=1000, help="each session's own opening message")
    p.add_argument("--turn-tokens", type=int, default=300, help="tool output added by each turn")
    p.add_argument("--prefill-us-per-token", type=float, default=100.0)
    p.add_argument("--token-delay-ms", type=float, default=5.0)
    p.add_argument("--affinity-balance", type=float, default=1.0, help="[routing] affinity_balance (ε)")
    args = p.parse_args()
    arms = [run_arm(args, "affinity on", REPLICAS, True),
            run_arm(args, "affinity off (least in flight)", REPLICAS, False),
            # The ceiling: one replica sees every turn (its cache holds the whole workload).
            run_arm(args, "one replica (ceiling)", 1, True)]
    print(f"\n{args.sessions} sessions × {args.turns} turns on {REPLICAS} replicas; "
          f"shared prefix {args.shared_tokens}, "
          f"session context {args.context_tokens}, +{args.turn_tokens} tokens a turn; prefill "
          f"{args.prefill_us_per_token:g} µs per uncached token\n")
    print("| routing | cached-token ratio | turns 2+ | turns 2+ on a warm replica | TTFT p50 ms | TTFT p90 ms "
          "| TTFT mean ms | requests per replica | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        ttfts = sorted(t.ttft_s * 1000 for t in arm.turns)
        p90 = ttfts[int(0.9 * (len(ttfts) - 1))]
        print(f"| {arm.name} | {arm.ratio():.3f} | {arm.ratio(first_turn=False):.3f} | {arm.stayed():.2f} "
              f"| {statistics.median(ttfts):.0f} "
              f"| {p90:.0f} | {statistics.fmean(ttfts):.0f} | {' '.join(map(str, arm.per_replica))} "
              f"| {arm.seconds:.1f} |")
    print("\n" + "\n".join(arm.ledger for arm in arms))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind like Ctrl-C: every process is stopped
    try:
        main()
    except BenchError as exc:
        sys.exit(f"benchmark failed: {exc}")
    except KeyboardInterrupt:
        sys.exit("interrupted; all started processes stopped")

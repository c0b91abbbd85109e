"""``kiln sim``: a vLLM-compatible (0.33 wire format) model-server simulator.

Used as the upstream in Kiln's tests, demo and benchmarks: deterministic output,
exact token accounting, and switchable vLLM quirks / faults (see ``SimSettings``
and the per-request ``"sim"`` control object documented in ``api.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web

from .api import SIM_KEY, create_app
from .server import SimServer
from .settings import SimSettings, split_names

__all__ = ["SIM_KEY", "SimServer", "SimSettings", "build_parser", "create_app", "main", "serve", "settings_from_args"]


def build_parser(prog: str = "kiln sim") -> argparse.ArgumentParser:
    """CLI flags; names match SimSettings fields (and /sim/config keys)."""
    p = argparse.ArgumentParser(prog=prog, description="Simulated vLLM OpenAI-compatible server.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100, help="0 picks a free port")
    p.add_argument("--model", action="append", dest="models", metavar="NAME",
                   help="served model name (repeatable; default: demo-model)")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--ttft-ms", type=float, default=0.0)
    p.add_argument("--token-delay-ms", type=float, default=0.0)
    p.add_argument("--prefill-us-per-token", type=float, default=0.0,
                   help="extra time to first token per prompt token not in the prefix cache (µs)")
    p.add_argument("--id", default="", metavar="NAME",
                   help="name sent as the x-sim-id header and in /sim/stats (default: host:port)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reply-tokens", type=int, default=24, help="default reply length in tokens")
    p.add_argument("--reasoning-models", default="", metavar="NAME,...",
                   help="models that emit reasoning before the answer")
    p.add_argument("--reasoning-field", choices=["reasoning", "reasoning_content"], default="reasoning")
    p.add_argument("--ignore-stop", action="store_true", help="mimic a stack that ignores `stop`")
    p.add_argument("--forced-tool-choice-fails", action="store_true",
                   help='tool_choice "required" -> plain 500; named -> empty arguments')
    p.add_argument("--legacy-length-check", action="store_true",
                   help="vLLM 0.16: prompt+max_tokens > max_model_len -> 400 (default: clamp)")
    p.add_argument("--no-prompt-tokens-details", action="store_true",
                   help="omit usage.prompt_tokens_details")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    return p


def settings_from_args(argv: list[str] | None = None) -> SimSettings:
    """Parse CLI arguments into SimSettings."""
    a = build_parser().parse_args(argv)
    return SimSettings(
        host=a.host,
        port=a.port,
        models=split_names(a.models) or ["demo-model"],
        max_model_len=a.max_model_len,
        ttft_ms=a.ttft_ms,
        token_delay_ms=a.token_delay_ms,
        prefill_us_per_token=a.prefill_us_per_token,
        id=a.id,
        seed=a.seed,
        reply_tokens=a.reply_tokens,
        reasoning_models=split_names(a.reasoning_models),
        reasoning_field=a.reasoning_field,
        ignore_stop=a.ignore_stop,
        forced_tool_choice_fails=a.forced_tool_choice_fails,
        legacy_length_check=a.legacy_length_check,
        no_prompt_tokens_details=a.no_prompt_tokens_details,
        api_key=a.api_key,
    )


async def serve(settings: SimSettings, stop: asyncio.Event | None = None) -> None:
    """Run until ``stop`` is set (or SIGINT/SIGTERM), printing the listening line.

    handler_cancellation=True makes aiohttp cancel a handler whose client went away,
    which is how non-streaming disconnects get counted as cancelled.
    """
    app = create_app(settings)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=2048)
    await site.start()
    server = site._server  # noqa: SLF001 - only way to learn the port picked for --port 0
    if server is not None and getattr(server, "sockets", None):
        settings.port = server.sockets[0].getsockname()[1]
    if not settings.id:
        settings.id = f"{settings.host}:{settings.port}"
    print(f"kiln sim listening on http://{settings.host}:{settings.port}", flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    """Entry point for ``kiln sim`` / ``python -m kiln.sim`` (uses uvloop when available)."""
    settings = settings_from_args(argv)
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        asyncio.run(serve(settings))
    else:
        uvloop.run(serve(settings))

"""The access log: one structured line per request, for the operator's log pipeline.

JSON (one object a line) when stderr is not a terminal or with `[log] format = "json"`;
`key=value` text on a terminal or with "text". A line carries the generation id and the
organisation, project and key ids, never a key's secret, and never anything per chunk.
The request path calls `log_request` once per request, when its outcome is known.

Levels: a 5xx is logged as a warning, everything else as info, so `[log] level = "warning"`
keeps only the gateway's and the backends' failures and "error" turns the log off.
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
import time
from datetime import datetime, timezone
from functools import lru_cache
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from kiln.config import LogSettings
from kiln.core.money import nano_to_usd_str
from kiln.core.records import ApiKey, UsageEvent
from kiln.running import running_loop

_json = True
_out: IO[str] = sys.stderr
_min_level = logging.INFO
_pending: list[str] = []  # lines not yet written: they go out together (`_write`)
_flush_scheduled = False
FLUSH_S = 0.1  # a line is written at most this long after its request ended ...
MAX_PENDING = 512  # ... or once this many wait


def configure(settings: LogSettings, stream: IO[str] | None = None) -> None:
    """Send access lines to `stream` (stderr) in the configured format, at the configured level."""
    global _json, _out, _min_level
    flush()
    stream = stream or sys.stderr
    _out = stream
    _min_level = logging.getLevelName(settings.level.upper())
    _json = settings.format == "json" or (settings.format == "auto" and not _isatty(stream))


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def log_request(
    *,
    status: int,
    endpoint: str,
    duration_ms: float,
    event: UsageEvent | None = None,
    key: ApiKey | None = None,
    model: str | None = None,
    backend: str | None = None,
    error: str | None = None,
) -> None:
    """One line for one request: a metered one from its usage `event`; a refused one (no event)
    from its `key` if it got that far. `error` is the metrics' error type, if it failed."""
    if (logging.WARNING if status >= 500 else logging.INFO) < _min_level:
        return
    owner: Any = event or key
    fields: dict[str, Any] = {
        "time": _now(),
        "generation_id": event.id if event else None,
        "org_id": owner.org_id if owner else None,
        "project_id": owner.project_id if owner else None,
        "key_id": event.key_id if event else (key.id if key else None),
        "model": event.model if event else model,
        "endpoint": endpoint,
        "status": status,
        "error": error,
        "prompt_tokens": event.prompt_tokens if event else 0,
        "cached_tokens": event.cached_tokens if event else 0,
        "completion_tokens": event.completion_tokens if event else 0,
        "reasoning_tokens": event.reasoning_tokens if event else 0,
        "cost": nano_to_usd_str(event.cost_nano) if event else "0",
        "ttft_ms": None if not event or event.ttft_ms is None else round(event.ttft_ms, 1),
        "duration_ms": round(duration_ms, 1),
        "backend": safe_url(backend or (event.backend if event else None)),
        "cancelled": event.cancelled if event else False,
    }
    _write(_render_json(fields) if _json else _render_text(fields))


def _write(line: str) -> None:
    """Queue a line; the lines of a tenth of a second (`FLUSH_S`, or `MAX_PENDING` lines) go
    out in one write, as a web server's buffered access log does.

    Not through `logging`: a LogRecord, the handler's lock and a flush per line were half of an
    access line's cost. A write per turn of the event loop was still about one write (and its
    flush through the text layer) per request at low concurrency: about 10,000 instructions a
    request. A process killed outright loses at most the last tenth of a second's lines (the
    usage ledger is what must not lose anything); shutdown and exit write them."""
    global _flush_scheduled
    _pending.append(line)
    if _flush_scheduled:
        if len(_pending) >= MAX_PENDING:
            flush()
        return
    try:
        loop = running_loop()
    except RuntimeError:  # no event loop (a command-line tool, a test): at once
        flush()
        return
    _flush_scheduled = True
    loop.call_later(FLUSH_S, flush)


def flush() -> None:
    """Write the queued lines (the loop calls it; so does shutdown)."""
    global _flush_scheduled
    _flush_scheduled = False
    if not _pending:
        return
    text = "\n".join(_pending) + "\n"
    _pending.clear()
    try:
        _out.write(text)
        _out.flush()
    except (OSError, ValueError):  # stderr closed or broken: the lines are lost, never a request
        pass


_second: list[Any] = [-1, ""]  # the last whole second formatted, and its text
_MILLIS = [f".{ms:03d}Z" for ms in range(1000)]  # a format spec per line cost more than the rest of the time


def _now() -> str:
    """UTC with milliseconds, e.g. 2026-12-01T13:42:35.901Z; the date and time part is formatted
    once a second (datetime's isoformat is most of an access line's cost otherwise)."""
    now = time.time()
    second = int(now)
    if second != _second[0]:
        _second[:] = second, datetime.fromtimestamp(second, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return _second[1] + _MILLIS[int((now - second) * 1000)]


@lru_cache(maxsize=256)
def safe_url(url: str | None) -> str | None:
    """A backend URL without any user:password in it."""
    if not url or "@" not in url:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


def _render_json(fields: dict[str, Any]) -> str:
    fields["cost"] = orjson.Fragment(fields["cost"].encode())  # an exact decimal number, as on the API
    return orjson.dumps(fields).decode()


def _render_text(fields: dict[str, Any]) -> str:
    return " ".join(f"{name}={_text(value)}" for name, value in fields.items() if value is not None)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return orjson.dumps(text).decode()  # quoted and escaped
    return text


atexit.register(flush)
_NEEDS_QUOTES = re.compile(r'[\s"=\\]')

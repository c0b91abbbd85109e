"""Configuration: one TOML file plus environment variables for secrets.

Everything is validated at start, and every mistake is reported at once with
its place in the file (unknown field with a suggestion, bad URL, missing
price), so a typo never starts a gateway that silently ignores it.

Routing (`[routing]`, and per backend `weight`, `max_in_flight` and the
three timeouts): see `Routing` here and `kiln.catalog.Timeouts` for the
defaults and why they suit LLM serving; README's configuration section
lists them all.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kiln.catalog import BACKEND_KINDS, DEFAULT_MAX_IN_FLIGHT, TOOL_CHOICE_MODES, Timeouts
from kiln.core import redis_url

DEFAULT_PORT = 8080
DEMO_MODEL = "demo-model"


class ConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass
class Limits:
    """Per-organisation defaults; an organisation may override each."""

    rpm: int = 60
    tpm: int | None = None
    concurrency: int = 8
    count_tokens_rpm: int = 1200  # count_tokens calls per minute: no inference, no in-flight slot


@dataclass
class Routing:
    """How requests are spread over a model's backends, and when a backend counts as failing."""

    affinity: bool = True  # keep a conversation on one backend (its prefix cache); false: least loaded only
    # ε: a backend keeps a key while its load is under (1 + ε) × its share. A miss costs a whole
    # prefill, so the default tolerates twice the average (bench/affinity.py: 0.25 kept 79-92% of
    # turns on a warm replica, 1.0 kept 99%)
    affinity_balance: float = 1.0
    retries: int = 2  # other backends tried after a failure before the first byte
    queue_timeout_s: float = 5.0  # all backends at max_in_flight: wait this long for one, then 503
    eject_after: int = 5  # failed requests in a row (5xx, timeout, broken stream) that eject a backend
    ejection_s: float = 10.0  # first ejection; doubles with each ejection in a row
    max_ejection_s: float = 300.0
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # per backend, unless the backend sets its own
    timeouts: Timeouts = field(default_factory=Timeouts)  # per backend, unless the backend sets its own


@dataclass
class LogSettings:
    """The access log: one line per request (access_log.py)."""

    format: str = "auto"  # json | text | auto: JSON unless stderr is a terminal
    level: str = "info"  # info: every request; warning: only 5xx; error: none


@dataclass
class MetricsSettings:
    """GET /metrics (metrics.py): on the main port with the admin credential, and on `port`
    (if set) with none, bound to `host`."""

    port: int | None = None
    host: str = "127.0.0.1"
    org_label: bool = False  # label tokens and cost by organisation too (one series per org)


@dataclass
class TracingSettings:
    """OpenTelemetry traces (tracing.py): off unless `endpoint` names an OTLP/HTTP collector."""

    endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces
    service_name: str = "kiln"
    sample_ratio: float = 1.0


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    data_dir: Path = Path("kiln-data")
    database: str = ""  # "sqlite:///path" or "postgresql://host/db?schema=name"; default: <data_dir>/kiln.db
    sqlite_synchronous: str = "NORMAL"
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 3600.0
    keepalive_s: float = 15.0
    max_upstream_body_bytes: int = 64 * 1024 * 1024  # a backend's JSON answer
    max_upstream_event_bytes: int = 8 * 1024 * 1024  # one SSE event from a backend
    backend_retry_s: float = 5.0  # how often every backend is health-checked
    refresh_s: float = 2.0  # shared database: fallback poll for other gateways' changes (notices come at once)
    workers: int = 1  # gateway processes on one port; more than one needs redis_url and PostgreSQL
    redis_url: str = ""  # shared admission for several processes/replicas (also KILN_REDIS_URL)
    redis_prefix: str = "kiln"  # Redis key prefix: gateways sharing one prefix share limits
    database_pool: int = 4  # PostgreSQL connections per process
    ledger_wait_s: float = 10.0  # a request waits this long for its usage event to be durable, then 503
    ledger_linger_s: float = 0.1  # SQLite: journaled usage events wait at most this long to share a commit
    shutdown_grace_s: float = 30.0  # SIGTERM: running requests get this long, then streams are cut and billed
    header_timeout_s: float = 10.0  # a request's head must arrive within this (slowloris)
    body_timeout_s: float = 60.0  # and its body within this once the head is in
    max_header_bytes: int = 64 * 1024  # request line + headers; 431 beyond
    max_headers: int = 100  # header lines; 431 beyond
    max_connections: int = 10_000  # open connections (also capped by the open-file limit)
    log_level: str = "info"
    limits: Limits = field(default_factory=Limits)
    routing: Routing = field(default_factory=Routing)
    log: LogSettings = field(default_factory=LogSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    models: list[dict[str, Any]] = field(default_factory=list)  # validated model tables
    demo: bool = False  # no models configured: serve the simulated demo model
    admin_key: str | None = None  # from KILN_ADMIN_KEY
    reasoning_secret: str | None = None  # from KILN_REASONING_SECRET: replicas share Responses reasoning blobs
    test_clock: bool = False  # KILN_TEST_CLOCK=1: POST /admin/v1/clock moves time (tests only)

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{self.data_dir / 'kiln.db'}"

    @property
    def shared_database(self) -> bool:
        return self.database_url.startswith(("postgres://", "postgresql://"))


def check_workers(settings: Settings) -> list[str]:
    """Several processes need shared state: say which setting is missing instead of running
    with per-process limits."""
    if settings.workers < 1:
        return ["server.workers: expected a positive integer"]
    if settings.workers == 1:
        return []
    problems = []
    if not settings.redis_url:
        problems.append(f"server.workers = {settings.workers} needs shared admission (limits, budgets, slots):"
                        " set server.redis_url = \"redis://HOST:6379/0\" (or KILN_REDIS_URL)")
    if not settings.shared_database:
        problems.append(f"server.workers = {settings.workers} needs PostgreSQL (SQLite is one process's store):"
                        " set server.database = \"postgresql://USER@HOST/DB\" (or KILN_DATABASE)")
    return problems


_SERVER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "host": str, "port": int, "data_dir": str, "database": str, "sqlite_synchronous": str,
    "max_body_bytes": int, "request_timeout_s": (int, float), "keepalive_s": (int, float),
    "backend_retry_s": (int, float), "refresh_s": (int, float), "max_upstream_body_bytes": int, "max_upstream_event_bytes": int,
    "log_level": str, "shutdown_grace_s": (int, float), "header_timeout_s": (int, float),
    "body_timeout_s": (int, float), "max_header_bytes": int, "max_headers": int, "max_connections": int,
    "workers": int, "redis_url": str, "redis_prefix": str, "database_pool": int,
    "ledger_wait_s": (int, float), "ledger_linger_s": (int, float),
}
_POSITIVE_SERVER_FIELDS = ("ledger_linger_s", "shutdown_grace_s", "header_timeout_s", "body_timeout_s",
                           "max_header_bytes", "max_headers", "max_connections")
# [routing] and per-backend fields: name -> what a valid value is
TIMEOUT_FIELDS = {"connect_timeout_s": "connect_s", "headers_timeout_s": "headers_s", "idle_timeout_s": "idle_s"}
_ROUTING_FIELDS = {"affinity": "bool", "affinity_balance": "ratio", "retries": "count", "queue_timeout_s": "ratio",
                   "eject_after": "positive", "ejection_s": "seconds", "max_ejection_s": "seconds",
                   "max_in_flight": "positive", **{name: "seconds" for name in TIMEOUT_FIELDS}}
_LIMIT_FIELDS: dict[str, type | tuple[type, ...]] = {"rpm": int, "tpm": int, "concurrency": int,
                                                      "count_tokens_rpm": int}
LOG_FORMATS = ("auto", "json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_MODEL_FIELDS = {
    "id", "aliases", "backends", "context_window", "max_output_tokens", "prices",
    "capabilities", "family", "owned_by", "simulated",
}
_BACKEND_FIELDS = {"url", "model", "api_key_env", "weight", "max_in_flight", "kind", *TIMEOUT_FIELDS}
PRICE_FIELDS = ("input", "cached_input", "output")
_CAP_FIELDS = {"image_input", "tool_choice", "parallel_tool_calls", "reasoning", "response_format"}


def load(path: str | Path | None, env: dict[str, str] | None = None) -> Settings:
    """Read and validate the configuration; raises ConfigError listing every problem."""
    env = dict(os.environ if env is None else env)
    raw = _read(path)
    problems: list[str] = []
    _unknown(raw, {"server", "limits", "routing", "log", "metrics", "tracing", "models"}, "", problems)
    settings = Settings()
    _check_server(_table(raw, "server", problems), settings, problems)
    limits = _table(raw, "limits", problems)
    _unknown(limits, set(_LIMIT_FIELDS), "limits.", problems)
    for name in _LIMIT_FIELDS:
        if name in limits:
            if not _positive_int(limits[name]):
                problems.append(f"limits.{name}: expected a positive integer, got {limits[name]!r}")
            else:
                setattr(settings.limits, name, limits[name])
    _check_log(_table(raw, "log", problems), settings.log, problems)
    _check_metrics(_table(raw, "metrics", problems), settings.metrics, problems)
    _check_tracing(_table(raw, "tracing", problems), settings.tracing, problems)
    settings.routing = _routing(_table(raw, "routing", problems), problems)
    _apply_env(env, settings, problems)
    models = _check_models(raw, env, problems)
    if problems:
        raise ConfigError(problems)
    settings.models = models
    settings.demo = not models
    return settings


def _read(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError([f"{path}: file not found"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: not valid TOML: {exc}"]) from None


def _check_server(server: dict[str, Any], settings: Settings, problems: list[str]) -> None:
    _unknown(server, set(_SERVER_FIELDS), "server.", problems)
    for name, kind in _SERVER_FIELDS.items():
        if name in server:
            value = server[name]
            if not isinstance(value, kind) or isinstance(value, bool):
                problems.append(f"server.{name}: expected {_kind(kind)}, got {value!r}")
            else:
                setattr(settings, name, Path(value) if name == "data_dir" else value)
    for name in _POSITIVE_SERVER_FIELDS:
        if getattr(settings, name) <= 0:
            problems.append(f"server.{name}: expected a positive number, got {getattr(settings, name)!r}")
    if settings.sqlite_synchronous.upper() not in ("NORMAL", "FULL"):
        problems.append("server.sqlite_synchronous: expected 'normal' or 'full'")


def _apply_env(env: dict[str, str], settings: Settings, problems: list[str]) -> None:
    """Environment overrides (for containers and tests) and secrets; the URLs they may set, checked."""
    for var, name, conv in (
        ("KILN_HOST", "host", str), ("KILN_PORT", "port", int), ("KILN_DATA_DIR", "data_dir", Path),
        ("KILN_DATABASE", "database", str), ("KILN_REDIS_URL", "redis_url", str),
        ("KILN_REDIS_PREFIX", "redis_prefix", str), ("KILN_WORKERS", "workers", int),
    ):
        if var in env:
            try:
                setattr(settings, name, conv(env[var]))
            except ValueError:
                problems.append(f"{var}: not a valid {name}: {env[var]!r}")
    if settings.redis_url:
        try:
            redis_url.parse(settings.redis_url)
        except ValueError as exc:  # its message never holds the URL, which may hold a password
            problems.append(f"server.redis_url: {exc}")
    if settings.database and not settings.database.startswith(("sqlite:///", "postgres://", "postgresql://")):
        scheme = settings.database.partition(":")[0]  # not the URL: it may hold a password
        problems.append(f"server.database: expected sqlite:///PATH or postgresql://..., got a URL of scheme {scheme!r}")
    settings.admin_key = env.get("KILN_ADMIN_KEY") or None
    settings.reasoning_secret = env.get("KILN_REASONING_SECRET") or None
    settings.test_clock = env.get("KILN_TEST_CLOCK") == "1"


def _check_models(raw: dict[str, Any], env: dict[str, str], problems: list[str]) -> list[Any]:
    """The [[models]] tables, each checked, and no name (id or alias) used twice."""
    models = raw.get("models", [])
    if not isinstance(models, list):
        problems.append("models: expected an array of tables ([[models]])")
        return []
    names: dict[str, str] = {}
    for i, model in enumerate(models):
        _check_model(model, f"models[{i}]", env, problems)
        if isinstance(model, dict):
            where = f"models[{model.get('id') or i}]"
            aliases = model.get("aliases") if isinstance(model.get("aliases"), list) else []
            for name in [model.get("id"), *aliases]:
                if isinstance(name, str) and name:
                    if name in names:
                        problems.append(f"{where}: the name {name!r} is already used by {names[name]}")
                    names.setdefault(name, where)
    return models


def _check_log(table: dict[str, Any], log: LogSettings, problems: list[str]) -> None:
    _unknown(table, {"format", "level"}, "log.", problems)
    for name, allowed in (("format", LOG_FORMATS), ("level", LOG_LEVELS)):
        if name in table:
            value = table[name]
            if not isinstance(value, str) or value.lower() not in allowed:
                problems.append(f"log.{name}: expected one of {', '.join(allowed)}, got {value!r}")
            else:
                setattr(log, name, value.lower())


def _check_metrics(table: dict[str, Any], metrics: MetricsSettings, problems: list[str]) -> None:
    _unknown(table, {"port", "host", "org_label"}, "metrics.", problems)
    if "port" in table:
        if not _positive_int(table["port"]) or table["port"] > 65535:
            problems.append(f"metrics.port: expected a port number (1-65535), got {table['port']!r}")
        else:
            metrics.port = table["port"]
    if "host" in table:
        if not isinstance(table["host"], str) or not table["host"]:
            problems.append(f"metrics.host: expected an address to listen on, got {table['host']!r}")
        else:
            metrics.host = table["host"]
    if "org_label" in table:
        if not isinstance(table["org_label"], bool):
            problems.append("metrics.org_label: expected true or false")
        else:
            metrics.org_label = table["org_label"]


def _check_tracing(table: dict[str, Any], tracing: TracingSettings, problems: list[str]) -> None:
    _unknown(table, {"endpoint", "service_name", "sample_ratio"}, "tracing.", problems)
    endpoint = table.get("endpoint")
    if endpoint is not None:
        parsed = urlparse(endpoint) if isinstance(endpoint, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            problems.append(f"tracing.endpoint: expected an OTLP/HTTP URL such as http://127.0.0.1:4318/v1/traces, "
                            f"got {endpoint!r}")
        else:
            tracing.endpoint = endpoint
    if "service_name" in table:
        if not isinstance(table["service_name"], str) or not table["service_name"]:
            problems.append("tracing.service_name: expected a name")
        else:
            tracing.service_name = table["service_name"]
    if "sample_ratio" in table:
        ratio = table["sample_ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            problems.append(f"tracing.sample_ratio: expected a number from 0 to 1, got {ratio!r}")
        else:
            tracing.sample_ratio = float(ratio)


def _routing(table: dict[str, Any], problems: list[str]) -> Routing:
    _unknown(table, set(_ROUTING_FIELDS), "routing.", problems)
    routing = Routing()
    timeouts: dict[str, float] = {}
    for name, rule in _ROUTING_FIELDS.items():
        if name in table and _valid(table[name], rule, f"routing.{name}", problems):
            if name in TIMEOUT_FIELDS:
                timeouts[TIMEOUT_FIELDS[name]] = float(table[name])
            else:
                setattr(routing, name, table[name])
    if routing.max_ejection_s < routing.ejection_s:
        problems.append("routing.max_ejection_s: must not be less than routing.ejection_s")
    routing.timeouts = Timeouts(**timeouts)
    return routing


def _valid(value: Any, rule: str, where: str, problems: list[str]) -> bool:
    """Check a routing value: bool, count (>= 0 integer), positive (> 0 integer),
    ratio (>= 0 number) or seconds (> 0 number)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {
        "bool": isinstance(value, bool),
        "count": number and isinstance(value, int) and value >= 0,
        "positive": _positive_int(value),
        "ratio": number and value >= 0,
        "seconds": number and value > 0,
    }[rule]
    if not ok:
        expected = {"bool": "true or false", "count": "an integer >= 0", "positive": "a positive integer",
                    "ratio": "a number >= 0", "seconds": "a number of seconds > 0"}[rule]
        problems.append(f"{where}: expected {expected}, got {value!r}")
    return ok


def _check_model(m: Any, where: str, env: dict[str, str], problems: list[str]) -> None:
    if not isinstance(m, dict):
        problems.append(f"{where}: expected a table")
        return
    if not isinstance(m.get("id"), str) or not m.get("id"):
        problems.append(f"{where}.id: required, a non-empty string")
    else:
        where = f"models[{m['id']}]"
    _unknown(m, _MODEL_FIELDS, f"{where}.", problems)
    aliases = m.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        problems.append(f"{where}.aliases: expected a list of names")
    if not _positive_int(m.get("context_window")):
        problems.append(f"{where}.context_window: required, a positive integer")
    if "max_output_tokens" in m and not _positive_int(m["max_output_tokens"]):
        problems.append(f"{where}.max_output_tokens: expected a positive integer")
    _check_prices(m.get("prices"), where, problems)
    _check_capabilities(m.get("capabilities", {}), where, problems)
    backends = m.get("backends")
    if not isinstance(backends, list) or not backends:
        problems.append(f"{where}.backends: at least one backend ([[models.backends]] with url)")
        return
    for j, b in enumerate(backends):
        _check_backend(b, f"{where}.backends[{j}]", env, problems)


def _check_prices(prices: Any, where: str, problems: list[str]) -> None:
    if not isinstance(prices, dict):
        problems.append(f"{where}.prices: required table with input, cached_input and output (USD per 1M tokens)")
        return
    _unknown(prices, set(PRICE_FIELDS), f"{where}.prices.", problems)
    for name in ("input", "output"):
        if name not in prices:
            problems.append(f"{where}.prices.{name}: missing price (USD per 1M tokens)")
    for name in PRICE_FIELDS:
        if name in prices and not _price_ok(prices[name]):
            problems.append(f"{where}.prices.{name}: expected a non-negative decimal, got {prices[name]!r}")


def _check_capabilities(caps: Any, where: str, problems: list[str]) -> None:
    if not isinstance(caps, dict):
        problems.append(f"{where}.capabilities: expected a table")
        return
    _unknown(caps, _CAP_FIELDS, f"{where}.capabilities.", problems)
    modes = caps.get("tool_choice", ["auto", "none"])
    if not isinstance(modes, list) or any(x not in TOOL_CHOICE_MODES for x in modes):
        problems.append(f"{where}.capabilities.tool_choice: a list of {', '.join(TOOL_CHOICE_MODES)}")
    for name in _CAP_FIELDS - {"tool_choice"}:
        if name in caps and not isinstance(caps[name], bool):
            problems.append(f"{where}.capabilities.{name}: expected true or false")


def _check_backend(b: Any, bw: str, env: dict[str, str], problems: list[str]) -> None:
    if not isinstance(b, dict):
        problems.append(f"{bw}: expected a table")
        return
    _unknown(b, _BACKEND_FIELDS, f"{bw}.", problems)
    url = b.get("url")
    parsed = urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        problems.append(f"{bw}.url: expected an http(s) URL such as http://127.0.0.1:8000/v1, got {url!r}")
    if "model" in b and not isinstance(b["model"], str):
        problems.append(f"{bw}.model: expected the upstream model name")
    if "kind" in b and b["kind"] not in BACKEND_KINDS:
        problems.append(f"{bw}.kind: expected one of {', '.join(BACKEND_KINDS)} (or leave it out: detected), "
                        f"got {b['kind']!r}")
    for name, rule in (("weight", "positive"), ("max_in_flight", "positive"),
                       *((name, "seconds") for name in TIMEOUT_FIELDS)):
        if name in b:
            _valid(b[name], rule, f"{bw}.{name}", problems)
    var = b.get("api_key_env")
    if var is not None and (not isinstance(var, str) or var not in env):
        problems.append(f"{bw}.api_key_env: environment variable {var!r} is not set")


def _unknown(table: dict[str, Any], allowed: set[str], prefix: str, problems: list[str]) -> None:
    for name in table:
        if name not in allowed:
            hint = difflib.get_close_matches(name, sorted(allowed), n=1)
            problems.append(f"{prefix}{name}: unknown field" + (f" (did you mean {hint[0]!r}?)" if hint else ""))


def _table(raw: dict[str, Any], name: str, problems: list[str]) -> dict[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        problems.append(f"{name}: expected a table ([{name}])")
        return {}
    return value


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _price_ok(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        return False
    return d.is_finite() and d >= 0


def _kind(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({"str": "a string", "int": "an integer", "float": "a number"}[k.__name__] for k in kinds)

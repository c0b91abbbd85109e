"""The `kiln` command: serve the gateway, run the simulator, administer.

    kiln serve [--config kiln.toml] [--host H] [--port P] [--data-dir D] [--workers N]
    kiln migrate [--config kiln.toml]            (apply the database's pending schema migrations)
    kiln sim [--port P] ...                      (the vLLM-like model-server simulator)
    kiln admin [--json] orgs|projects|keys|usage|maintenance|backends ...   (talks to a running gateway)
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from kiln import config
from kiln.config import ConfigError, Settings
from kiln.workers import reuse_port_socket, supervise, worker_index

DEMO_CREDITS_USD = "5"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sim":
        from kiln.sim import main as sim_main

        sim_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln LLM API gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the gateway")
    serve.add_argument("--config", help="TOML configuration file (default: $KILN_CONFIG or ./kiln.toml if present)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--data-dir")
    serve.add_argument("--workers", type=int, help="gateway processes on one port (needs redis_url and PostgreSQL)")
    migrate = sub.add_parser("migrate", help="apply the database's pending schema migrations")
    migrate.add_argument("--config", help="TOML configuration file (default: $KILN_CONFIG or ./kiln.toml if present)")
    sub.add_parser("sim", help="start the model-server simulator (see `kiln sim --help`)")
    _admin_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve_command(args)
    elif args.command == "migrate":
        migrate_command(args)
    else:
        admin_command(args)


# -- serve ----------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> Settings:
    path = args.config or os.environ.get("KILN_CONFIG")
    if path is None and Path("kiln.toml").exists():
        path = "kiln.toml"
    args.config = path
    try:
        return config.load(path)
    except ConfigError as exc:
        print(f"kiln: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def serve_command(args: argparse.Namespace) -> None:
    settings = _settings(args)
    if args.host:
        settings.host = args.host
    if args.port is not None:
        settings.port = args.port
    if args.data_dir:
        settings.data_dir = Path(args.data_dir)
    if args.workers is not None:
        settings.workers = args.workers
    index = worker_index()
    if index is not None:
        settings.workers = 1  # one of the parent's workers
    problems = config.check_workers(settings)
    if problems:
        print("kiln: " + "\n".join(problems), file=sys.stderr)
        raise SystemExit(2)
    if settings.workers > 1:
        argv = ["serve", *(["--config", args.config] if args.config else []),
                *(["--host", args.host] if args.host else []), *(["--data-dir", args.data_dir] if args.data_dir else [])]
        raise SystemExit(supervise(settings.workers, settings.host, settings.port, argv))
    # Imported here, not at the top: a parent of several workers serves nothing and stays small.
    from kiln import wiring
    from kiln.app import create_app
    from kiln.server import serve

    sim_url = start_demo_simulator() if settings.demo else None
    catalog = wiring.build_catalog(settings, sim_url=sim_url)

    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the database and keys live here
    bootstrap = index in (None, 0)  # one worker shows the first-start credentials
    app = create_app(settings, catalog=catalog, on_ready=lambda gw: _bootstrap(gw, settings) if bootstrap else None)
    serve(app, settings, sockets=[reuse_port_socket(settings.host, settings.port)] if index is not None else None)


def migrate_command(args: argparse.Namespace) -> None:
    """Apply pending migrations (for PostgreSQL, before rolling out a new version: docs/deploy.md)."""
    import asyncio

    from kiln.store import make_store

    settings = _settings(args)

    async def run() -> list[str]:
        store = make_store(settings.database_url)
        try:
            return await store.migrate()
        finally:
            await store.close()

    applied = asyncio.run(run())
    print(f"kiln: applied {', '.join(applied)}" if applied else "kiln: the schema is up to date")


def start_demo_simulator() -> str:
    """Start `kiln sim` for the demo model; returns its /v1 base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.sim", "--port", "0", "--model", config.DEMO_MODEL, "--token-delay-ms", "20"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_die_with_parent,
    )
    atexit.register(proc.terminate)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        raise SystemExit("kiln: the demo simulator did not start")
    url = line.rsplit(" ", 1)[-1].strip()
    print(f"kiln: demo mode: model '{config.DEMO_MODEL}' is SIMULATED by `kiln sim` at {url}", flush=True)
    return url + "/v1"


def _die_with_parent() -> None:
    """Linux: the simulator gets SIGTERM when the gateway dies, however it dies."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


async def _bootstrap(gw: Any, settings: Settings) -> None:
    """First start: an admin credential, and in demo mode a demo org and key; each shown once."""
    accounts = gw.accounts
    base = f"http://{settings.host}:{settings.port}"
    if not settings.admin_key:
        admin_key = await accounts.create_admin_key()
        if admin_key:
            print(f"\nkiln: admin credential (shown once, store it): {admin_key}\n"
                  f"      use it as KILN_ADMIN_KEY for `kiln admin ...`", flush=True)
    if settings.demo and not accounts.orgs:
        from kiln.core.money import usd_to_nano

        org = await accounts.create_org("demo")
        await accounts.add_credits(org.id, usd_to_nano(DEMO_CREDITS_USD), "demo credits")
        project = await accounts.create_project(org.id, "default")
        _, secret = await accounts.create_key(project.id, "demo")
        print(_DEMO_SNIPPET.format(key=secret, base=base, model=config.DEMO_MODEL, credits=DEMO_CREDITS_USD),
              flush=True)


_DEMO_SNIPPET = """
kiln: demo key (shown once, ${credits} of credits): {key}

Try it:

curl {base}/v1/chat/completions \\
  -H "Authorization: Bearer {key}" \\
  -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}' -i

python3 - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="{base}/v1", api_key="{key}")
resp = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
print(resp.choices[0].message.content, resp.usage)
PY
"""


# -- admin ----------------------------------------------------------------------


def _admin_parser(sub: Any) -> None:
    admin = sub.add_parser("admin", help="administer a running gateway through /admin/v1")
    admin.add_argument("--url", default=os.environ.get("KILN_URL", "http://127.0.0.1:8080"))
    admin.add_argument("--admin-key", default=os.environ.get("KILN_ADMIN_KEY"))
    admin.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    what = admin.add_subparsers(dest="what", required=True)
    groups = (_orgs_parser(what), _projects_parser(what), _keys_parser(what), _usage_parser(what),
              _maintenance_parser(what))
    for group in groups:  # `--json` after the verb too
        for verb_parser in group.choices.values():
            verb_parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                                     help="print the API's JSON instead of a table")
    backends = what.add_parser("backends", help="each backend's state, requests in flight, latency, last error")
    backends.add_argument("--json", action="store_true", help="the raw /admin/v1/backends answer")


def _orgs_parser(what: Any) -> Any:
    """`kiln admin orgs ...`"""
    orgs = what.add_parser("orgs").add_subparsers(dest="verb", required=True)
    orgs.add_parser("list")
    c = orgs.add_parser("create")
    c.add_argument("name")
    c.add_argument("--credits")
    c.add_argument("--monthly-budget")
    for limit in ("--rpm-limit", "--tpm-limit", "--concurrency-limit"):
        c.add_argument(limit, type=int)
    g = orgs.add_parser("show")
    g.add_argument("org_id")
    cr = orgs.add_parser("add-credits")
    cr.add_argument("org_id")
    cr.add_argument("amount")
    cr.add_argument("--note", default="")
    b = orgs.add_parser("set")
    b.add_argument("org_id")
    b.add_argument("--monthly-budget")
    for limit in ("--rpm-limit", "--tpm-limit", "--concurrency-limit"):
        b.add_argument(limit, type=int)
    return orgs


def _projects_parser(what: Any) -> Any:
    """`kiln admin projects ...`"""
    projects = what.add_parser("projects").add_subparsers(dest="verb", required=True)
    pl = projects.add_parser("list")
    pl.add_argument("--org-id")
    pc = projects.add_parser("create")
    pc.add_argument("org_id")
    pc.add_argument("name")
    return projects


def _keys_parser(what: Any) -> Any:
    """`kiln admin keys ...`"""
    keys = what.add_parser("keys").add_subparsers(dest="verb", required=True)
    kl = keys.add_parser("list")
    kl.add_argument("--project-id")
    kc = keys.add_parser("create")
    kc.add_argument("project_id")
    kc.add_argument("--name", default="")
    kc.add_argument("--spend-limit")
    kc.add_argument("--expires-at", help="Unix time or ISO 8601")
    _key_limit_args(kc)
    for verb in ("suspend", "reactivate", "revoke"):
        keys.add_parser(verb).add_argument("key_id")
    ks = keys.add_parser("set")
    ks.add_argument("key_id")
    ks.add_argument("--spend-limit")
    ks.add_argument("--expires-at")
    _key_limit_args(ks)
    return keys


def _usage_parser(what: Any) -> Any:
    """`kiln admin usage ...`"""
    usage = what.add_parser("usage").add_subparsers(dest="verb", required=True)
    ul = usage.add_parser("list")
    ul.add_argument("--org-id")
    ul.add_argument("--key-id")
    ul.add_argument("--limit", type=int, default=20)
    us = usage.add_parser("summary", help="requests, tokens and cost per group, e.g. --by day,model")
    us.add_argument("--by", default="day", help="comma-separated: day, org, project, key, model, endpoint")
    for name in ("--org-id", "--project-id", "--key-id", "--model"):
        us.add_argument(name)
    us.add_argument("--since", help="Unix time or ISO 8601 (UTC unless an offset is given)")
    us.add_argument("--until", help="Unix time or ISO 8601, exclusive")
    us.add_argument("--csv", action="store_true", help="print CSV (for a spreadsheet)")
    return usage


def _maintenance_parser(what: Any) -> Any:
    """`kiln admin maintenance ...`"""
    maint = what.add_parser("maintenance").add_subparsers(dest="verb", required=True)
    maint.add_parser("show")
    mon = maint.add_parser("on")
    mon.add_argument("until", help="end of maintenance: Unix time or ISO 8601")
    mon.add_argument("--message")
    maint.add_parser("off")
    return maint


def _key_limit_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spend-reset", choices=["never", "daily", "weekly", "monthly"])
    for limit in ("--rpm-limit", "--tpm-limit", "--concurrency-limit"):
        parser.add_argument(limit, type=int)


def admin_command(args: argparse.Namespace) -> None:
    if not args.admin_key:
        raise SystemExit("kiln admin: set KILN_ADMIN_KEY or pass --admin-key")
    w, v = args.what, getattr(args, "verb", None)
    if w == "backends":
        answer = _call(args.url, args.admin_key, "GET", "/backends", None)
        print(json.dumps(answer, indent=2) if args.json else backends_table(answer["data"]))
        return
    limits = {n: getattr(args, n, None) for n in ("rpm_limit", "tpm_limit", "concurrency_limit")}
    limits = {k: val for k, val in limits.items() if val is not None}
    key_limits = {**limits, **({"spend_reset": args.spend_reset} if getattr(args, "spend_reset", None) else {})}
    calls: dict[tuple[str, str], tuple[str, str, dict[str, Any] | None]] = {
        ("orgs", "list"): ("GET", "/orgs", None),
        ("orgs", "create"): ("POST", "/orgs", {"name": getattr(args, "name", None), "credits": getattr(args, "credits", None),
                                               "monthly_budget": getattr(args, "monthly_budget", None), **limits}),
        ("orgs", "show"): ("GET", f"/orgs/{getattr(args, 'org_id', '')}", None),
        ("orgs", "add-credits"): ("POST", f"/orgs/{getattr(args, 'org_id', '')}/credits",
                                  {"amount": getattr(args, "amount", None), "note": getattr(args, "note", "")}),
        ("orgs", "set"): ("PATCH", f"/orgs/{getattr(args, 'org_id', '')}",
                          {**({"monthly_budget": args.monthly_budget} if getattr(args, "monthly_budget", None) else {}),
                           **limits}),
        ("projects", "list"): ("GET", "/projects" + _query(org_id=getattr(args, "org_id", None)), None),
        ("projects", "create"): ("POST", "/projects", {"org_id": getattr(args, "org_id", None),
                                                       "name": getattr(args, "name", None)}),
        ("keys", "list"): ("GET", "/keys" + _query(project_id=getattr(args, "project_id", None)), None),
        ("keys", "create"): ("POST", "/keys", {"project_id": getattr(args, "project_id", None),
                                               "name": getattr(args, "name", ""),
                                               "spend_limit": getattr(args, "spend_limit", None),
                                               "expires_at": _when(getattr(args, "expires_at", None)),
                                               **key_limits}),
        ("keys", "set"): ("PATCH", f"/keys/{getattr(args, 'key_id', '')}",
                          {**{k: val for k, val in (("spend_limit", getattr(args, "spend_limit", None)),
                                                    ("expires_at", _when(getattr(args, "expires_at", None))))
                              if val is not None}, **key_limits}),
        ("usage", "list"): ("GET", "/usage" + _query(org_id=getattr(args, "org_id", None),
                                                     key_id=getattr(args, "key_id", None),
                                                     limit=getattr(args, "limit", None)), None),
        ("usage", "summary"): ("GET", "/usage/summary" + (".csv" if getattr(args, "csv", False) else "")
                               + _query(**{n: getattr(args, n, None) for n in (
                                   "by", "org_id", "project_id", "key_id", "model", "since", "until")}), None),
        ("maintenance", "show"): ("GET", "/maintenance", None),
        ("maintenance", "on"): ("PUT", "/maintenance", {"until": _when(getattr(args, "until", None)),
                                                        **({"message": args.message} if getattr(args, "message", None)
                                                           else {})}),
        ("maintenance", "off"): ("PUT", "/maintenance", {"until": None}),
    }
    if w == "keys" and v in ("suspend", "reactivate", "revoke"):
        method, path, body = "POST", f"/keys/{args.key_id}/{v}", {}
    else:
        method, path, body = calls[(w, v)]
    result = _call(args.url, args.admin_key, method, path, body)
    if isinstance(result, str):  # CSV, as it came
        sys.stdout.write(result)
    elif args.json:
        print(json.dumps(result, indent=2))
    else:
        from kiln import tables

        note = result.pop("note", None) if isinstance(result, dict) else None  # a new key's "shown once"
        print(tables.render("summary" if (w, v) == ("usage", "summary") else w, result))
        if note:
            print(f"\n{note}")


def backends_table(rows: list[dict[str, Any]]) -> str:
    """One line per backend, columns aligned."""
    head = ("MODEL", "URL", "STATE", "IN FLIGHT", "LATENCY", "REQUESTS", "ERRORS", "LAST ERROR")
    lines = [head] + [
        (r["model"], r["url"], r["state"] + (f" ({r['ejected_for_s']:g} s)" if r.get("ejected_for_s") else ""),
         f"{r['in_flight']}/{r['max_in_flight']}",
         "-" if r["latency_ms"] is None else f"{r['latency_ms']:g} ms",
         str(r["requests"]), str(r["errors"]), r["last_error"] or "-")
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in lines)


def _when(value: str | None) -> float | str | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value


def _query(**params: Any) -> str:
    pairs = {k: v for k, v in params.items() if v is not None}
    return "?" + urllib.parse.urlencode(pairs) if pairs else ""


def _call(url: str, admin_key: str, method: str, path: str, body: dict[str, Any] | None) -> Any:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url.rstrip("/") + "/admin/v1" + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            if resp.headers.get_content_type() == "text/csv":
                return raw.decode()
            return json.loads(raw or b"null")
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"kiln admin: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
    except urllib.error.URLError as exc:
        raise SystemExit(f"kiln admin: cannot reach {url}: {exc.reason}") from None

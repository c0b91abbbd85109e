"""Build the gateway's parts from the settings (the catalog of models and backends, the
stores and admission), and close them in order.

One gateway process (the embedded default): SQLite, in-process admission, no
spool. Several processes or replicas: PostgreSQL (the truth: keys, balances,
the ledger), Redis for admission shared by all (`redis_url`), a durable local
spool for usage events while PostgreSQL is unreachable, and change notices so
every process takes a change within a second.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable

from kiln.catalog import Backend, Capabilities, Catalog, Model, Timeouts
from kiln.config import DEMO_MODEL, PRICE_FIELDS, TIMEOUT_FIELDS, Routing, Settings
from kiln.core.accounts import ADMIN_HASH_META, Accounts
from kiln.core.admission import AdmissionControl, MemoryAdmission
from kiln.core.clock import CLOCK, Clock
from kiln.core.journal import Journal
from kiln.core.keys import hash_key
from kiln.core.ledger import Ledger
from kiln.core.maintenance import Maintenance, load as load_maintenance
from kiln.core.money import Prices
from kiln.core.propagation import Propagation
from kiln.core.spool import Spool
from kiln.store import make_store
from kiln.store.base import Store

log = logging.getLogger("kiln")


@dataclass
class Parts:
    store: Store
    accounts: Accounts
    admission: AdmissionControl
    ledger: Ledger
    propagation: Propagation | None = None


async def open_parts(settings: Settings, *, store: Store | None = None, admission: AdmissionControl | None = None,
                     clock: Clock = CLOCK, on_metrics: Callable[[float, int], None] | None = None) -> Parts:
    """Store, caches, admission and ledger, open and running; `store` and `admission` if given
    (a test building a gateway in process), else from the settings."""
    store = store or make_store(settings.database_url, settings.sqlite_synchronous, settings.database_pool)
    await store.open()
    if settings.admin_key:  # the only admin credential: it replaces the stored one (rotation)
        await store.set_meta(ADMIN_HASH_META, hash_key(settings.admin_key))
    redis_admission = None
    if admission is None and settings.redis_url:
        from kiln.core.admission_redis import RedisAdmission  # hiredis is an optional dependency

        redis_admission = RedisAdmission(settings.redis_url, settings.limits, store, settings.redis_prefix, clock)
    accounts = Accounts(store, clock, take_balances=redis_admission is not None)
    spool = None
    if store.shared:  # the database may be unreachable for a while: usage waits on local disk
        spool = Spool(settings.data_dir / "spool")
        spool.open()
    if redis_admission is not None:
        accounts.on_credits = redis_admission.push_balances
        admission = redis_admission
    elif admission is None:
        if store.shared:  # one gateway on PostgreSQL is fine; a second one without Redis is refused
            await store.hold_sole_admission()  # type: ignore[attr-defined]
        admission = MemoryAdmission(settings.limits, clock)
    journal = None
    if not store.shared and redis_admission is None and settings.sqlite_synchronous.upper() == "NORMAL":
        journal = Journal(settings.data_dir / "journal")  # as durable as a NORMAL commit, far cheaper
    ledger = Ledger(store, wait_s=settings.ledger_wait_s, linger_s=settings.ledger_linger_s, spool=spool,
                    journal=journal, dead_letter_file=settings.data_dir / "dead-letters.jsonl",
                    on_commit=redis_admission.committed if redis_admission else None,
                    on_balances=accounts.take_credits if redis_admission else None, on_metrics=on_metrics)
    parts = Parts(store, accounts, admission, ledger)
    await ledger.start()  # what an earlier run journaled is committed first: balances include it
    await accounts.load()
    if redis_admission is not None:
        redis_admission.ledger = ledger
        await redis_admission.start()
    return parts


async def start_propagation(parts: Parts, settings: Settings, maintenance: Maintenance) -> None:
    """Load the stored maintenance mode into the gateway's, and, on a shared database, keep
    keys, limits, balances and maintenance in step with the other processes."""
    await load_maintenance(parts.store, maintenance)
    if parts.store.shared:
        push = getattr(parts.admission, "push_balances", None)
        parts.propagation = Propagation(parts.store, parts.accounts, maintenance, settings.refresh_s, push)
        await parts.propagation.start()


async def close_parts(parts: Parts) -> None:
    """Stop in order: notices; lease renewing and sweeping; the ledger (flushes, reports commits to
    admission); admission (settles that waited for Redis); the store."""
    redis_admission = parts.admission if hasattr(parts.admission, "stop_tasks") else None
    if parts.propagation is not None:
        await parts.propagation.stop()
    if redis_admission is not None:
        await redis_admission.stop_tasks()  # type: ignore[attr-defined]
    await parts.ledger.stop()
    if redis_admission is not None:
        await redis_admission.close()  # type: ignore[attr-defined]
    await parts.store.close()


def degraded(gateway: Any) -> list[str]:
    """Why this process refuses metered requests now (empty: it serves them). A database that
    is unreachable while the spool takes the usage is no refusal, only a note."""
    problems = []
    if gateway.ledger.degraded:
        problems.append(f"ledger cannot write: {gateway.ledger.failure}")
    if getattr(gateway.admission, "reachable", True) is False:
        problems.append("shared admission (Redis) unreachable")
    return problems


def build_catalog(settings: Settings, env: dict[str, str] | None = None, sim_url: str | None = None) -> Catalog:
    """The catalog from validated settings; in demo mode, the simulated demo model."""
    env = dict(os.environ if env is None else env)
    if settings.demo:
        assert sim_url is not None, "demo mode needs the simulator's URL"
        return Catalog([demo_model(sim_url)])
    return Catalog([_model(m, env, settings.routing) for m in settings.models])


def demo_model(sim_url: str) -> Model:
    return Model(
        id=DEMO_MODEL,
        backends=[Backend(url=sim_url.rstrip("/"), model=DEMO_MODEL)],
        prices=Prices(Decimal("0.10"), Decimal("0.05"), Decimal("0.40")),
        context_window=32768,
        max_output_tokens=8192,
        capabilities=Capabilities(tool_choice=frozenset({"auto", "none"})),
        family="simulated",
        simulated=True,
    )


def _model(m: dict[str, Any], env: dict[str, str], routing: Routing) -> Model:
    caps = m.get("capabilities", {})
    prices = m["prices"]
    return Model(
        id=m["id"],
        aliases=tuple(m.get("aliases", ())),
        backends=[_backend(b, m["id"], env, routing) for b in m["backends"]],
        prices=Prices(*(Decimal(str(prices.get(n, prices["input"]))) for n in PRICE_FIELDS)),
        context_window=m["context_window"],
        max_output_tokens=m.get("max_output_tokens", m["context_window"]),
        capabilities=Capabilities(
            image_input=caps.get("image_input", False),
            tool_choice=frozenset(caps.get("tool_choice", ("auto", "none"))),
            parallel_tool_calls=caps.get("parallel_tool_calls", False),
            reasoning=caps.get("reasoning", False),
            response_format=caps.get("response_format", False),
        ),
        family=m.get("family", ""),
        owned_by=m.get("owned_by", "kiln"),
        simulated=m.get("simulated", False),
    )


def _backend(b: dict[str, Any], model_id: str, env: dict[str, str], routing: Routing) -> Backend:
    t = routing.timeouts
    return Backend(
        url=b["url"].rstrip("/"),
        model=b.get("model", model_id),
        api_key=env.get(b["api_key_env"]) if b.get("api_key_env") else None,
        weight=b.get("weight", 1),
        max_in_flight=b.get("max_in_flight", routing.max_in_flight),
        timeouts=Timeouts(**{attr: float(b.get(name, getattr(t, attr))) for name, attr in TIMEOUT_FIELDS.items()}),
        kind=b.get("kind", ""),
    )

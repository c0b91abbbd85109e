"""The storage interface the domain core talks to.

One SQLite implementation ships now (the embedded default); a PostgreSQL one
implements the same coroutine methods. Nothing on the request's hot path
calls the store directly: keys and balances live in memory, and usage events
reach the store in batches through the ledger writer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

import orjson

from kiln.core.records import ApiKey, Org, Project, UsageEvent

# Column lists shared by the SQL implementations, in the records' field order.
ORG_COLUMNS = "id, name, credits_nano, monthly_budget_nano, rpm_limit, tpm_limit, concurrency_limit, created_at"
KEY_COLUMNS = (
    "id, project_id, org_id, key_hash, prefix, name, status, spend_limit_nano, expires_at, spend_nano, created_at,"
    " spend_reset, rpm_limit, tpm_limit, concurrency_limit"
)
USAGE_COLUMNS = (
    "id, created_at, org_id, project_id, key_id, model, endpoint, prompt_tokens, cached_tokens,"
    " completion_tokens, reasoning_tokens, cost_nano, status, cancelled, ttft_ms, duration_ms,"
    " streamed, finish_reason, backend"
)
USAGE_COLUMN_COUNT = USAGE_COLUMNS.count(",") + 1
ORG_UPDATABLE = {"name", "credits_nano", "monthly_budget_nano", "rpm_limit", "tpm_limit", "concurrency_limit"}
KEY_UPDATABLE = {
    "name", "status", "spend_limit_nano", "expires_at", "spend_reset", "rpm_limit", "tpm_limit", "concurrency_limit"
}


def usage_rows(events: list[UsageEvent]) -> list[tuple[Any, ...]]:
    """Events as rows in USAGE_COLUMNS order."""
    return [
        (e.id, e.created_at, e.org_id, e.project_id, e.key_id, e.model, e.endpoint, e.prompt_tokens,
         e.cached_tokens, e.completion_tokens, e.reasoning_tokens, e.cost_nano, e.status,
         e.cancelled, e.ttft_ms, e.duration_ms, e.streamed, e.finish_reason, e.backend)
        for e in events
    ]


def usage_event(row: Any) -> UsageEvent:
    """A row in USAGE_COLUMNS order as an event (SQLite gives booleans as 0/1)."""
    event = UsageEvent(*row)
    event.cancelled, event.streamed = bool(event.cancelled), bool(event.streamed)
    return event


def event_json(event: UsageEvent) -> bytes:
    """An event as one JSON line (the journal, the spool and the dead-letter records): orjson (one
    per request in the journal), or the standard library's encoder for an integer beyond 64 bits
    (the absurd ones that get an event set aside)."""
    try:
        return orjson.dumps(event)
    except orjson.JSONEncodeError:
        return json.dumps(asdict(event), separators=(",", ":")).encode()


def event_from_json(raw: bytes | str) -> UsageEvent:
    return UsageEvent(**json.loads(raw))


def cost_by_owner(events: list[UsageEvent]) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(cost, org_id) and (cost, key_id) sums of a batch, in a stable order (no deadlocks)."""
    orgs: dict[str, int] = {}
    keys: dict[str, int] = {}
    for e in events:
        if e.cost_nano:
            orgs[e.org_id] = orgs.get(e.org_id, 0) + e.cost_nano
            keys[e.key_id] = keys.get(e.key_id, 0) + e.cost_nano
    return [(c, o) for o, c in sorted(orgs.items())], [(c, k) for k, c in sorted(keys.items())]


# What usage can be grouped by (an admin's `by`), and the column each one reads; "day" is a UTC date.
USAGE_GROUPS = {"day": "", "org": "org_id", "project": "project_id", "key": "key_id", "model": "model",
                "endpoint": "endpoint"}
USAGE_TOTALS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "cost_nano")


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Which usage events to add up (all given filters apply) and how to group them."""

    by: tuple[str, ...] = ()
    org_id: str | None = None
    project_id: str | None = None
    key_id: str | None = None
    model: str | None = None
    since: float | None = None  # Unix time, inclusive
    until: float | None = None  # Unix time, exclusive

    def __post_init__(self) -> None:
        unknown = [g for g in self.by if g not in USAGE_GROUPS]
        if unknown or len(set(self.by)) != len(self.by):
            raise ValueError(f"cannot group usage by {self.by!r}")

    def columns(self) -> list[str]:
        """The names of a summary row's group fields, in `by` order."""
        return [USAGE_GROUPS[g] or g for g in self.by]


def usage_summary_sql(q: UsageQuery, day_sql: str, param: Callable[[int], str]) -> tuple[str, list[Any]]:
    """One GROUP BY over usage_events for `q`; `day_sql` renders created_at as a UTC
    YYYY-MM-DD date and `param(n)` the n-th placeholder, per dialect. Only names from
    USAGE_GROUPS reach the SQL text; every value is a parameter."""
    groups = [(USAGE_GROUPS[g] or day_sql) for g in q.by]
    where, args = [], []
    for column in ("org_id", "project_id", "key_id", "model"):
        value = getattr(q, column)
        if value is not None:
            args.append(value)
            where.append(f"{column} = {param(len(args))}")
    for op, value in ((">=", q.since), ("<", q.until)):
        if value is not None:
            args.append(value)
            where.append(f"created_at {op} {param(len(args))}")
    select = [f"{g} AS g{i}" for i, g in enumerate(groups)]
    select += ["COUNT(*)"] + [f"COALESCE(SUM({c}), 0)" for c in USAGE_TOTALS[1:]]
    sql = f"SELECT {', '.join(select)} FROM usage_events"
    if where:
        sql += " WHERE " + " AND ".join(where)
    if groups:
        order = ", ".join(f"g{i}" for i in range(len(groups)))
        sql += f" GROUP BY {order} ORDER BY {order}"
    return sql, args


def summary_rows(q: UsageQuery, rows: list[Any]) -> list[dict[str, Any]]:
    """Result rows as dicts: the group fields, then USAGE_TOTALS as integers."""
    names = q.columns()
    return [
        {**dict(zip(names, row)), **{t: int(v) for t, v in zip(USAGE_TOTALS, row[len(names):])}}
        for row in rows
        if row[len(names)]  # no events: SQL's one all-zero row of an ungrouped empty sum
    ]


def check_updatable(table: str, allowed: set[str], fields: dict[str, Any]) -> None:
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"cannot update {sorted(unknown)} on {table}")


@dataclass(slots=True)
class Snapshot:
    """Everything the in-memory caches are built from at start-up."""

    orgs: list[Org]
    projects: list[Project]
    keys: list[ApiKey]


@dataclass(slots=True)
class Balances:
    """What admission rebuilds a shared counter from: the committed truth for one org and key."""

    credits_nano: int
    credits_version: int  # grows with every change of the balance
    month_spend_nano: int  # since the month start asked for
    key_spend_nano: int  # since the key's period start asked for (all of it for keys that never reset)


# (credits, version) of each organisation whose balance a write moved.
CreditBalances = dict[str, tuple[int, int]]
OnChange = Callable[[str], None]  # what changed: "accounts", "credits", "maintenance" or "*" (anything)


class Store(Protocol):
    shared: bool  # other gateway processes may write the same database

    async def open(self) -> None:
        """Connect, and bring the schema up to date where the store may (SQLite; an empty PostgreSQL
        schema); raises OutdatedSchema when `kiln migrate` must run first."""

    async def migrate(self) -> list[str]:
        """Apply the pending migrations; returns their names (`kiln migrate`)."""

    async def close(self) -> None: ...

    def is_unavailable(self, exc: BaseException) -> bool:
        """True when `exc` means the store cannot write now (down, disk full), False when the data
        was refused (a bad event): the ledger retries the first and sets the second aside."""

    async def load(self, month_start: float | None) -> Snapshot:
        """All orgs (with spend since month_start, unless None), projects and keys."""

    async def insert_org(self, org: Org) -> None: ...
    async def update_org(self, org_id: str, fields: dict[str, Any]) -> None: ...
    async def add_credits(self, org_id: str, amount_nano: int, note: str) -> tuple[int, int]:
        """Add (or, negative, remove) credits; returns the new balance and its version."""

    async def insert_project(self, project: Project) -> None: ...
    async def insert_key(self, key: ApiKey) -> None: ...
    async def update_key(self, key_id: str, fields: dict[str, Any]) -> None: ...

    async def record_usage(self, events: list[UsageEvent], *, waited: bool = True) -> CreditBalances:
        """Insert the events that are not there yet (by id) and, in the same transaction, deduct
        the cost of those inserted from their organisations' credits and add it to their keys'
        spend: writing an event twice bills it once. Returns the balances it moved. `waited`:
        a request or a read waits for this commit (False: the events are durable already, in
        the journal, and the commit may take longer if it keeps requests from waiting)."""

    async def dead_letter(self, event: UsageEvent, error: str) -> None:
        """Set aside an event no write could take, with the reason."""

    async def balances(self, org_id: str, key_id: str, month_start: float, key_since: float | None) -> Balances:
        """Committed credits, month spend and key period spend (key_since None: all its spend)."""

    async def credit_balances(self) -> CreditBalances:
        """Every organisation's credits and version (shared admission re-reads them as a fallback)."""

    async def listen(self, on_change: OnChange) -> None:
        """Call `on_change(what)` whenever another process changes keys, organisations, credits
        or settings; runs until cancelled (returns at once where nothing is shared)."""

    async def key_spend_since(self, since: float) -> dict[str, int]:
        """Spend per key since a time (for spend limits that reset)."""

    async def list_usage(
        self, org_id: str | None = None, key_id: str | None = None, limit: int = 100
    ) -> list[UsageEvent]: ...
    async def get_usage(self, event_id: str) -> UsageEvent | None: ...
    async def usage_summary(self, query: UsageQuery) -> list[dict[str, Any]]:
        """Requests, tokens and cost (nanodollars) per group of `query.by`, in group order."""

    async def usage_totals(self, org_id: str) -> dict[str, int]:
        """{'events': n, 'cost_nano': sum, 'granted_nano': credits ever added}."""

    async def get_meta(self, name: str) -> str | None: ...
    async def set_meta(self, name: str, value: str) -> None: ...


class OutdatedSchema(RuntimeError):
    """The database's schema lacks migrations this version needs: run `kiln migrate` first."""

"""The storage interface the domain core talks to.

One SQLite implementation ships now (the embedded default); a PostgreSQL one
implements the same coroutine methods. Nothing on the request's hot path
calls the store directly: keys and balances live in memory, and usage events
reach the store in batches through the ledger writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from kiln.core.records import ApiKey, Org, Project, UsageEvent

# Column lists shared by the SQL implementations, in the records' field order.
ORG_COLUMNS = "id, name, credits_nano, monthly_budget_nano, rpm_limit, tpm_limit, concurrency_limit, created_at"
KEY_COLUMNS = (
    "id, project_id, org_id, key_hash, prefix, name, status, spend_limit_nano, expires_at, spend_nano, created_at,"
    " spend_reset, rpm_limit, tpm_limit, concurrency_limit"
)
USAGE_COLUMNS = (
    "id, created_at, org_id, project_id, key_id, model, endpoint, prompt_tokens, cached_tokens,"
    " completion_tokens, reasoning_tokens, cost_nano, status, cancelled, ttft_ms, duration_ms"
)
ORG_UPDATABLE = {"name", "credits_nano", "monthly_budget_nano", "rpm_limit", "tpm_limit", "concurrency_limit"}
KEY_UPDATABLE = {
    "name", "status", "spend_limit_nano", "expires_at", "spend_reset", "rpm_limit", "tpm_limit", "concurrency_limit"
}


def usage_rows(events: list[UsageEvent]) -> list[tuple[Any, ...]]:
    """Events as rows in USAGE_COLUMNS order."""
    return [
        (e.id, e.created_at, e.org_id, e.project_id, e.key_id, e.model, e.endpoint, e.prompt_tokens,
         e.cached_tokens, e.completion_tokens, e.reasoning_tokens, e.cost_nano, e.status,
         e.cancelled, e.ttft_ms, e.duration_ms)
        for e in events
    ]


def cost_by_owner(events: list[UsageEvent]) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(cost, org_id) and (cost, key_id) sums of a batch, in a stable order (no deadlocks)."""
    orgs: dict[str, int] = {}
    keys: dict[str, int] = {}
    for e in events:
        if e.cost_nano:
            orgs[e.org_id] = orgs.get(e.org_id, 0) + e.cost_nano
            keys[e.key_id] = keys.get(e.key_id, 0) + e.cost_nano
    return [(c, o) for o, c in sorted(orgs.items())], [(c, k) for k, c in sorted(keys.items())]


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


class Store(Protocol):
    shared: bool  # other gateway processes may write the same database

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def load(self, month_start: float | None) -> Snapshot:
        """All orgs (with spend since month_start, unless None), projects and keys."""

    async def insert_org(self, org: Org) -> None: ...
    async def update_org(self, org_id: str, fields: dict[str, Any]) -> None: ...
    async def add_credits(self, org_id: str, amount_nano: int, note: str) -> int:
        """Add (or, negative, remove) credits; returns the new balance."""

    async def insert_project(self, project: Project) -> None: ...
    async def insert_key(self, key: ApiKey) -> None: ...
    async def update_key(self, key_id: str, fields: dict[str, Any]) -> None: ...

    async def record_usage(self, events: list[UsageEvent]) -> None:
        """Insert the events and, in the same transaction, deduct each cost
        from its organisation's credits and add it to its key's spend."""

    async def key_spend_since(self, since: float) -> dict[str, int]:
        """Spend per key since a time (for spend limits that reset)."""

    async def list_usage(
        self, org_id: str | None = None, key_id: str | None = None, limit: int = 100
    ) -> list[UsageEvent]: ...
    async def usage_totals(self, org_id: str) -> dict[str, int]:
        """{'events': n, 'cost_nano': sum, 'granted_nano': credits ever added}."""

    async def get_meta(self, name: str) -> str | None: ...
    async def set_meta(self, name: str, value: str) -> None: ...

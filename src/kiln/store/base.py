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


@dataclass(slots=True)
class Snapshot:
    """Everything the in-memory caches are built from at start-up."""

    orgs: list[Org]
    projects: list[Project]
    keys: list[ApiKey]


class Store(Protocol):
    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def load(self, month_start: float) -> Snapshot:
        """All orgs (with spend since month_start), projects and keys."""

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

    async def list_usage(
        self, org_id: str | None = None, key_id: str | None = None, limit: int = 100
    ) -> list[UsageEvent]: ...
    async def usage_totals(self, org_id: str) -> dict[str, int]:
        """{'events': n, 'cost_nano': sum, 'granted_nano': credits ever added}."""

    async def get_meta(self, name: str) -> str | None: ...
    async def set_meta(self, name: str, value: str) -> None: ...

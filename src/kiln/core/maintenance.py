"""Maintenance mode: every metered request answers 503 with Retry-After until a time.

Kept in the store's meta table, so a restart does not forget it and every
replica sees it (kiln.core.propagation refreshes it on each change notice).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import format_datetime

import orjson

from kiln.core import errors
from kiln.core.clock import Clock
from kiln.core.errors import GatewayError
from kiln.store.base import Store

META_KEY = "maintenance"


@dataclass
class Maintenance:
    clock: Clock
    until: float | None = None  # Unix time; None: not in maintenance
    message: str = "The service is in maintenance."

    @property
    def active(self) -> bool:
        return self.until is not None and self.until > self.clock.time()

    def error(self) -> GatewayError:
        assert self.until is not None
        when = format_datetime(datetime.fromtimestamp(self.until, timezone.utc), usegmt=True)
        err = errors.unavailable(f"{self.message} Retry after {when}.", headers={"Retry-After": when})
        err.reason = "maintenance"
        return err


async def load(store: Store, maintenance: Maintenance) -> None:
    """Maintenance mode as stored, into `maintenance`."""
    raw = await store.get_meta(META_KEY)
    if raw:
        stored = orjson.loads(raw)
        maintenance.until, maintenance.message = stored.get("until"), stored.get("message") or maintenance.message


async def save(store: Store, maintenance: Maintenance) -> None:
    await store.set_meta(META_KEY, orjson.dumps({"until": maintenance.until,
                                                 "message": maintenance.message}).decode())

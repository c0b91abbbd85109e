"""Changes made on one replica reach every other one within a second.

Key status and limits, organisation limits, credit top-ups and maintenance
mode are written to the shared database, which announces each change
(PostgreSQL NOTIFY, in the change's own transaction). Every process listens
and refreshes at once; a poll every `refresh_s` is the fallback for notices
lost while the listener reconnects. Maintenance mode is kept in the store's
meta table, so a restart does not forget it either (SQLite included).

The catalog (models, backends, prices) comes from the configuration file and
has no reload: changing it is a rolling restart (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable


from kiln.core.accounts import Accounts
from kiln.core.maintenance import Maintenance, load as load_maintenance
from kiln.store.base import CreditBalances, Store

log = logging.getLogger("kiln.propagation")

DEBOUNCE_S = 0.05  # a burst of notices costs one refresh


class Propagation:
    def __init__(self, store: Store, accounts: Accounts, maintenance: Maintenance, every_s: float,
                 push_balances: Callable[[CreditBalances], Awaitable[None]] | None = None) -> None:
        self.store = store
        self.accounts = accounts
        self.maintenance = maintenance
        self.every_s = every_s
        self.push_balances = push_balances
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._refresh_forever(), name="kiln-refresh"),
                       asyncio.create_task(self.store.listen(self.notice), name="kiln-listen")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def notice(self, what: str) -> None:
        """Another process changed something: refresh now (a notice's text says what, but one
        refresh takes everything, which also covers notices missed)."""
        self._wake.set()

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.every_s)
                await asyncio.sleep(DEBOUNCE_S)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.refresh()
            except Exception as exc:
                log.warning("refreshing from the database failed: %s", exc)

    async def refresh(self) -> None:
        await self.accounts.refresh()
        await load_maintenance(self.store, self.maintenance)
        if self.push_balances is not None:  # shared admission: committed balances to Redis and the caches
            balances = await self.store.credit_balances()
            self.accounts.take_credits(balances)
            await self.push_balances(balances)

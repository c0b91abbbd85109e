"""Organisations, projects and keys, cached in memory in front of the store.

The hot path authenticates with one dictionary lookup; every change made
through this object reaches the cache at once, so suspending or revoking a
key takes effect on the next request.
"""

from __future__ import annotations

import logging
import secrets
import time
from datetime import datetime, timezone
from typing import Awaitable, Callable

from kiln.core import errors
from kiln.core.clock import CLOCK, Clock
from kiln.core.keys import ADMIN_PREFIX, display_prefix, hash_key, new_key, same_hash
from kiln.core.records import KEY_STATUSES, ApiKey, Org, Project
from kiln.store.base import Store

ADMIN_HASH_META = "admin_key_hash"
log = logging.getLogger("kiln.accounts")


_month: tuple[float, float, str] = (0.0, 0.0, "")  # [start, end) of the last month asked for


def month_of(ts: float) -> str:
    """Calendar month (UTC) of a Unix time, e.g. '2026-11'; cached, it is asked per request."""
    global _month
    start, end, name = _month
    if start <= ts < end:
        return name
    d = datetime.fromtimestamp(ts, timezone.utc)
    first = datetime(d.year, d.month, 1, tzinfo=timezone.utc)
    after = datetime(d.year + d.month // 12, d.month % 12 + 1, 1, tzinfo=timezone.utc)
    _month = (first.timestamp(), after.timestamp(), first.strftime("%Y-%m"))
    return _month[2]


def month_start(ts: float) -> float:
    d = datetime.fromtimestamp(ts, timezone.utc)
    return datetime(d.year, d.month, 1, tzinfo=timezone.utc).timestamp()


def period_of(reset: str, ts: float) -> str:
    """The spend-limit period a time falls in: '' (never resets), a day, an ISO week or a month (UTC)."""
    if reset == "monthly":
        return month_of(ts)
    if reset == "never":
        return ""
    d = datetime.fromtimestamp(ts, timezone.utc)
    if reset == "daily":
        return d.strftime("%Y-%m-%d")
    year, week, _ = d.isocalendar()
    return f"{year}-W{week:02d}"


def period_start(reset: str, ts: float) -> float:
    d = datetime.fromtimestamp(ts, timezone.utc)
    day = datetime(d.year, d.month, d.day, tzinfo=timezone.utc)
    if reset == "daily":
        return day.timestamp()
    if reset == "weekly":
        return day.timestamp() - d.weekday() * 86400.0
    return month_start(ts)


def roll_periods(org: Org | None, key: ApiKey | None, now: float) -> None:
    """Start a new month's budget and a new key spend period when the calendar moved on."""
    if org is not None:
        month = month_of(now)
        if org.month != month:
            org.month, org.month_spend_nano = month, 0
    if key is not None and key.spend_reset != "never":
        period = period_of(key.spend_reset, now)
        if key.period != period:
            key.period, key.period_spend_nano = period, 0


def charge(org: Org | None, key: ApiKey | None, cost_nano: int, now: float) -> None:
    """Apply a request's cost to the cached balances (its usage event commits right after), so
    admission sees every settled request, committed or not."""
    if not cost_nano:
        return
    roll_periods(org, key, now)
    if org is not None:
        org.credits_nano -= cost_nano
        org.month_spend_nano += cost_nano
    if key is not None:
        key.spend_nano += cost_nano
        key.period_spend_nano += cost_nano


_ORG_SETTINGS = ("name", "monthly_budget_nano", "rpm_limit", "tpm_limit", "concurrency_limit")
_KEY_SETTINGS = ("name", "status", "spend_limit_nano", "expires_at", "spend_reset", "rpm_limit", "tpm_limit",
                 "concurrency_limit")


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class Accounts:
    def __init__(self, store: Store, clock: Clock = CLOCK, take_balances: bool = False) -> None:
        self.store = store
        self.clock = clock
        # Shared admission (Redis) decides on balances itself: this cache only shows them, and takes
        # the committed ones from the database on refresh. In-process admission decides on these.
        self.take_balances = take_balances
        self.database_ok = True  # the last refresh could read the database: an unknown key is really unknown
        # Called with {org_id: (credits, version)} after a top-up here (shared admission takes it at once).
        self.on_credits: Callable[[dict[str, tuple[int, int]]], Awaitable[None]] | None = None
        self._credit_versions: dict[str, int] = {}
        self.orgs: dict[str, Org] = {}
        self.projects: dict[str, Project] = {}
        self.keys: dict[str, ApiKey] = {}  # by id
        self._by_hash: dict[str, ApiKey] = {}
        self._admin_hashes: list[str] = []

    async def load(self) -> None:
        now = self.clock.time()
        snap = await self.store.load(month_start(now))
        month = month_of(now)
        self.orgs = {o.id: o for o in snap.orgs}
        for org in self.orgs.values():
            org.month = month
        self.projects = {p.id: p for p in snap.projects}
        self.keys = {k.id: k for k in snap.keys}
        since = {reset: await self.store.key_spend_since(period_start(reset, now))
                 for reset in ("daily", "weekly", "monthly")}
        for key in self.keys.values():
            key.period = period_of(key.spend_reset, now)
            key.period_spend_nano = (
                key.spend_nano if key.spend_reset == "never" else since[key.spend_reset].get(key.id, 0)
            )
        self._by_hash = {k.key_hash: k for k in snap.keys}
        stored = await self.store.get_meta(ADMIN_HASH_META)
        self._admin_hashes = [stored] if stored else []

    def take_credits(self, balances: dict[str, tuple[int, int]]) -> None:
        """Committed credit balances (from a commit, a top-up or the poll), each taken only if newer
        than the one shown: with shared admission, credits here are for display."""
        for org_id, (credits, version) in balances.items():
            org = self.orgs.get(org_id)
            if org is not None and version > self._credit_versions.get(org_id, -1):
                org.credits_nano = credits
                self._credit_versions[org_id] = version

    async def refresh(self) -> None:
        """Take what other gateways changed in a shared database: new organisations, projects
        and keys, key status, limits and expiry (and, with shared admission, key spend).
        With in-process admission balances stay this process's own."""
        try:
            snap = await self.store.load(None)
        except Exception:
            self.database_ok = False
            raise
        self.database_ok = True
        month = month_of(self.clock.time())
        for org in snap.orgs:
            mine = self.orgs.get(org.id)
            if mine is None:
                org.month = month
                self.orgs[org.id] = org
            else:
                for name in _ORG_SETTINGS:
                    setattr(mine, name, getattr(org, name))
        for project in snap.projects:
            self.projects.setdefault(project.id, project)
        for key in snap.keys:
            mine = self.keys.get(key.id)
            if mine is None:
                key.period = period_of(key.spend_reset, self.clock.time())
                self.keys[key.id] = self._by_hash[key.key_hash] = key
            else:
                for name in _KEY_SETTINGS:
                    setattr(mine, name, getattr(key, name))
                if self.take_balances:
                    mine.spend_nano = key.spend_nano

    # -- the hot path -------------------------------------------------------

    def lookup(self, token: str) -> ApiKey | None:
        """The key for a token whatever its status (for GET /v1/key)."""
        return self._by_hash.get(hash_key(token))

    def authenticate(self, token: str) -> ApiKey:
        """The key for a presented token, or 401/403 per the contract; 503 for a key this process
        has not seen while the database cannot be asked (it may be a new, valid one)."""
        key = self._by_hash.get(hash_key(token))
        if key is None:
            if not self.database_ok:
                raise errors.unavailable("The gateway cannot check this API key right now (its database is"
                                         " unreachable); retry shortly.", headers={"Retry-After": "5"})
            raise errors.unauthorized("Invalid API key.")
        if key.expires_at is not None and key.expires_at <= self.clock.time():
            raise errors.unauthorized("This API key has expired.")
        if key.status != "active":
            raise errors.forbidden(f"This API key is {key.status}.", code=f"key_{key.status}")
        return key

    # -- admin credential ---------------------------------------------------

    def is_admin(self, token: str) -> bool:
        h = hash_key(token)
        return any(same_hash(h, stored) for stored in self._admin_hashes)

    async def create_admin_key(self) -> str | None:
        """Create and store the admin credential on first start; None if one exists."""
        if await self.store.get_meta(ADMIN_HASH_META):
            return None
        secret = new_key(ADMIN_PREFIX)
        await self.store.set_meta(ADMIN_HASH_META, hash_key(secret))
        self._admin_hashes.append(hash_key(secret))
        return secret

    # -- organisations and projects ----------------------------------------

    async def create_org(self, name: str, **limits: int | None) -> Org:
        if any(o.name == name for o in self.orgs.values()):
            raise errors.GatewayError(409, f"An organisation named {name!r} exists.", code="conflict")
        org = Org(id=_id("org"), name=name, created_at=time.time(), month=month_of(self.clock.time()), **limits)
        await self.store.insert_org(org)
        self.orgs[org.id] = org
        return org

    def org(self, org_id: str) -> Org:
        org = self.orgs.get(org_id)
        if org is None:
            raise errors.not_found(f"No organisation {org_id!r}.")
        return org

    async def update_org(self, org_id: str, **fields: int | None) -> Org:
        org = self.org(org_id)
        await self.store.update_org(org_id, fields)
        for name, value in fields.items():
            setattr(org, name, value)
        return org

    async def add_credits(self, org_id: str, amount_nano: int, note: str = "") -> Org:
        org = self.org(org_id)
        credits, version = await self.store.add_credits(org_id, amount_nano, note)
        if self.take_balances:
            self.take_credits({org_id: (credits, version)})
        else:  # this balance already counts the journaled events the store's does not yet
            org.credits_nano += amount_nano
        if self.on_credits is not None:
            await self.on_credits({org_id: (org.credits_nano, version)})
        return org

    async def create_project(self, org_id: str, name: str) -> Project:
        self.org(org_id)
        if any(p.org_id == org_id and p.name == name for p in self.projects.values()):
            raise errors.GatewayError(409, f"A project named {name!r} exists in {org_id}.", code="conflict")
        project = Project(id=_id("proj"), org_id=org_id, name=name, created_at=time.time())
        await self.store.insert_project(project)
        self.projects[project.id] = project
        return project

    def project(self, project_id: str) -> Project:
        project = self.projects.get(project_id)
        if project is None:
            raise errors.not_found(f"No project {project_id!r}.")
        return project

    # -- keys -----------------------------------------------------------------

    async def create_key(
        self,
        project_id: str,
        name: str = "",
        spend_limit_nano: int | None = None,
        expires_at: float | None = None,
        **limits: object,
    ) -> tuple[ApiKey, str]:
        """A new key and its secret; the secret is not kept anywhere."""
        project = self.project(project_id)
        secret = new_key()
        key = ApiKey(
            id=_id("key"),
            project_id=project.id,
            org_id=project.org_id,
            key_hash=hash_key(secret),
            prefix=display_prefix(secret),
            name=name,
            spend_limit_nano=spend_limit_nano,
            expires_at=expires_at,
            created_at=time.time(),
            **limits,  # type: ignore[arg-type]
        )
        key.period = period_of(key.spend_reset, self.clock.time())
        await self.store.insert_key(key)
        self.keys[key.id] = key
        self._by_hash[key.key_hash] = key
        return key, secret

    def key(self, key_id: str) -> ApiKey:
        key = self.keys.get(key_id)
        if key is None:
            raise errors.not_found(f"No key {key_id!r}.")
        return key

    async def set_key_status(self, key_id: str, status: str) -> ApiKey:
        key = self.key(key_id)
        if status not in KEY_STATUSES:
            raise errors.invalid(f"status must be one of {', '.join(KEY_STATUSES)}", param="status")
        if key.status == "revoked" and status != "revoked":
            raise errors.GatewayError(409, "A revoked key cannot be reactivated; create a new one.", code="conflict")
        await self.store.update_key(key_id, {"status": status})
        key.status = status
        return key

    async def update_key(self, key_id: str, **fields: object) -> ApiKey:
        key = self.key(key_id)
        await self.store.update_key(key_id, fields)
        for name, value in fields.items():
            setattr(key, name, value)
        if "spend_reset" in fields:
            now = self.clock.time()
            key.period = period_of(key.spend_reset, now)
            key.period_spend_nano = key.spend_nano if key.spend_reset == "never" else (
                await self.store.key_spend_since(period_start(key.spend_reset, now))
            ).get(key.id, 0)
        return key

"""Storage behind one interface (base.Store): SQLite embedded, PostgreSQL for scale-out."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kiln.store.base import Store


def make_store(url: str, sqlite_synchronous: str = "NORMAL", pool_size: int = 4) -> Store:
    """A store for a database URL: `sqlite:///path` or `postgresql://...[?schema=name]`."""
    if url.startswith(("postgres://", "postgresql://")):
        from kiln.store.postgres import PostgresStore  # asyncpg is an optional dependency

        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        schema = query.pop("schema", "public")
        dsn = urlunsplit(parts._replace(query=urlencode(query)))
        return PostgresStore(dsn, schema, pool_size)
    from kiln.store.sqlite import SQLiteStore

    return SQLiteStore(url.removeprefix("sqlite:///"), sqlite_synchronous)

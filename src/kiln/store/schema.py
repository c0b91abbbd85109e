"""The schema, once, for both SQL stores.

Migrations are numbered by their position; each store records the last one it
applied. The column types differ by dialect only where the engines differ.
"""

from __future__ import annotations

_TYPES = {
    "sqlite": {"money": "INTEGER", "time": "REAL", "serial": "INTEGER PRIMARY KEY AUTOINCREMENT",
               "boolean": "INTEGER", "false": "0", "seq": ""},
    "postgres": {"money": "BIGINT", "time": "DOUBLE PRECISION", "serial": "BIGSERIAL PRIMARY KEY",
                 "boolean": "BOOLEAN", "false": "FALSE", "seq": "        seq BIGSERIAL,\n"},  # SQLite orders by rowid
}

_MIGRATIONS: list[str] = [
    """
    CREATE TABLE orgs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        credits_nano {money} NOT NULL DEFAULT 0,
        monthly_budget_nano {money},
        rpm_limit INTEGER,
        tpm_limit INTEGER,
        concurrency_limit INTEGER,
        created_at {time} NOT NULL
    );
    CREATE TABLE projects (
        id TEXT PRIMARY KEY,
        org_id TEXT NOT NULL REFERENCES orgs(id),
        name TEXT NOT NULL,
        created_at {time} NOT NULL,
        UNIQUE (org_id, name)
    );
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        project_id TEXT NOT NULL REFERENCES projects(id),
        org_id TEXT NOT NULL REFERENCES orgs(id),
        key_hash TEXT NOT NULL UNIQUE,
        prefix TEXT NOT NULL,
        name TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'active',
        spend_limit_nano {money},
        expires_at {time},
        spend_nano {money} NOT NULL DEFAULT 0,
        created_at {time} NOT NULL
    );
    CREATE TABLE credit_grants (
        id {serial},
        org_id TEXT NOT NULL REFERENCES orgs(id),
        amount_nano {money} NOT NULL,
        note TEXT NOT NULL DEFAULT '',
        created_at {time} NOT NULL
    );
    CREATE TABLE usage_events (
{seq}        id TEXT PRIMARY KEY,
        created_at {time} NOT NULL,
        org_id TEXT NOT NULL,
        project_id TEXT NOT NULL,
        key_id TEXT NOT NULL,
        model TEXT NOT NULL,
        endpoint TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        reasoning_tokens INTEGER NOT NULL,
        cost_nano {money} NOT NULL,
        status TEXT NOT NULL,
        cancelled {boolean} NOT NULL,
        ttft_ms {time},
        duration_ms {time} NOT NULL
    );
    CREATE INDEX usage_events_org_time ON usage_events (org_id, created_at);
    CREATE INDEX usage_events_key_time ON usage_events (key_id, created_at);
    CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
    """
    ALTER TABLE api_keys ADD COLUMN spend_reset TEXT NOT NULL DEFAULT 'never';
    ALTER TABLE api_keys ADD COLUMN rpm_limit INTEGER;
    ALTER TABLE api_keys ADD COLUMN tpm_limit INTEGER;
    ALTER TABLE api_keys ADD COLUMN concurrency_limit INTEGER;
    """,
    # What GET /v1/generation reports beside the tokens: events from before this read false / null.
    """
    ALTER TABLE usage_events ADD COLUMN streamed {boolean} NOT NULL DEFAULT {false};
    ALTER TABLE usage_events ADD COLUMN finish_reason TEXT;
    ALTER TABLE usage_events ADD COLUMN backend TEXT;
    """,
]


def migrations(dialect: str) -> list[str]:
    """The DDL of every migration, in order, for "sqlite" or "postgres"."""
    return [sql.format(**_TYPES[dialect]) for sql in _MIGRATIONS]

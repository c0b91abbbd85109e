"""Readable tables for `kiln admin` (the default; `--json` prints the API's answer as it is).

A list becomes one row per item with the columns an operator reads first; a single object
becomes a field/value table. Times print as UTC, empty values as '-'; amounts stay the
exact decimal strings the API sends.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from kiln.store.base import UsageQuery

# The columns of each kind of list, in order.
COLUMNS: dict[str, tuple[str, ...]] = {
    "orgs": ("id", "name", "credits", "month_spend", "monthly_budget", "rpm_limit", "tpm_limit",
             "concurrency_limit"),
    "projects": ("id", "org_id", "name", "created_at"),
    "keys": ("id", "name", "prefix", "project_id", "status", "spend", "spend_limit", "spend_reset", "expires_at"),
    "usage": ("id", "created_at", "model", "endpoint", "status", "prompt_tokens", "completion_tokens", "cost"),
    "summary": ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "cost"),
}
_TIMES = {"created_at", "expires_at", "until"}
_NUMERIC = {"credits", "month_spend", "monthly_budget", "spend", "spend_limit", "period_spend", "cost",
            "total_spend", "total_granted", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
            "reasoning_tokens", "rpm_limit", "tpm_limit", "concurrency_limit", "usage_events", "in_flight"}


def render(kind: str, result: Any) -> str:
    """`result` (an admin API answer) as text; `kind` picks the list columns."""
    if isinstance(result, dict) and result.get("object") == "list":
        columns = COLUMNS[kind]
        if kind == "summary":
            columns = (*UsageQuery(by=tuple(result.get("by", []))).columns(), *columns)
        return table(columns, result["data"])
    if isinstance(result, dict):
        return _fields(result)
    return str(result)


def table(columns: tuple[str, ...] | list[str], rows: list[dict[str, Any]]) -> str:
    """Aligned columns under an upper-case header; numbers right-aligned."""
    cells = [[cell(c, row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if c in _NUMERIC else v.ljust(w)
                         for c, v, w in zip(columns, values, widths)).rstrip()

    out = [line([c.upper() for c in columns]), *(line(r) for r in cells)]
    if not rows:
        out.append("(none)")
    return "\n".join(out)


def _fields(obj: dict[str, Any]) -> str:
    flat = {}
    for name, value in obj.items():
        if isinstance(value, dict):  # one level down, e.g. a key's project
            flat.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            flat[name] = value
    width = max(len(n) for n in flat)
    return "\n".join(f"{n.ljust(width)}  {cell(n.rsplit('.', 1)[-1], v)}" for n, v in flat.items())


def cell(column: str, value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if column in _TIMES and isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)

"""Usage, read back from the ledger.

    GET /v1/generation?id=gen-...        a caller's own event (its API key), OpenRouter's field names
    GET /admin/v1/usage/summary          requests, tokens and cost grouped by day, org, project, key,
    GET /admin/v1/usage/summary.csv      model and endpoint (`by=day,model`), filtered; JSON or CSV

Neither is on the request path: each is one store query, never a scan in memory.
"""

from __future__ import annotations

import csv
import io
from datetime import datetime, timezone
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln import admin
from kiln.core import errors
from kiln.core.errors import GatewayError
from kiln.core.money import nano_to_usd_str
from kiln.core.records import UsageEvent
from kiln.pipeline import Gateway
from kiln.protocols.openai.errors import openai_error
from kiln.store.base import USAGE_GROUPS, USAGE_TOTALS, UsageQuery


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat()


def _usd_number(nano: int) -> orjson.Fragment:
    """An exact decimal JSON number (no float rounding), as usage.cost is on responses."""
    return orjson.Fragment(nano_to_usd_str(nano).encode())


def generation_stats(e: UsageEvent) -> dict[str, Any]:
    """One event as OpenRouter's GET /api/v1/generation `data` names it where a name fits.

    Kiln counts tokens with the model's own tokenizer, so `tokens_*` and `native_tokens_*`
    agree. Times are milliseconds: `latency` is the whole request, `time_to_first_token`
    (Kiln's; null unless streamed) the first content byte. The backend stays private.
    """
    return {
        "id": e.id,
        "model": e.model,
        "endpoint": e.endpoint,
        "created_at": iso_time(e.created_at),
        "streamed": e.streamed,
        "cancelled": e.cancelled,
        "status": e.status,
        "finish_reason": e.finish_reason,
        "tokens_prompt": e.prompt_tokens,
        "tokens_completion": e.completion_tokens,
        "native_tokens_prompt": e.prompt_tokens,
        "native_tokens_completion": e.completion_tokens,
        "native_tokens_cached": e.cached_tokens,
        "native_tokens_reasoning": e.reasoning_tokens,
        "total_cost": _usd_number(e.cost_nano),
        "latency": round(e.duration_ms),
        "time_to_first_token": None if e.ttft_ms is None else round(e.ttft_ms),
    }


async def generation(request: Request) -> Response:
    """GET /v1/generation: 404 alike for an unknown id and for another key's (no probing)."""
    gw: Gateway = request.app.state.gateway
    try:
        key = gw.authenticate(request.headers)
        gen_id = request.query_params.get("id")
        if not gen_id:
            raise errors.invalid("The query parameter 'id' is required: the X-Neocloud-Generation-Id of a "
                                 "response.", param="id")
        await gw.ledger.settled()
        event = await gw.accounts.store.get_usage(gen_id)
        if event is None or event.key_id != key.id:
            raise errors.not_found(f"No generation {gen_id!r} for this API key.", param="id",
                                   code="generation_not_found")
    except GatewayError as err:
        reply = openai_error(err)
        return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)
    return Response(orjson.dumps({"data": generation_stats(event)}), media_type="application/json")


# -- admin ---------------------------------------------------------------------------------------


def usage_query(params: admin.Params) -> UsageQuery:
    """The filters and grouping of a summary request: by, org_id, project_id, key_id, model,
    since and until (Unix time or ISO 8601; until is exclusive)."""
    by = tuple(part.strip() for part in params.get("by", "").split(",") if part.strip())
    if any(g not in USAGE_GROUPS for g in by) or len(set(by)) != len(by):
        raise errors.invalid(f"'by' takes distinct names among {', '.join(USAGE_GROUPS)}, comma-separated.",
                             param="by")
    return UsageQuery(
        by=by,
        org_id=params.get("org_id") or None,
        project_id=params.get("project_id") or None,
        key_id=params.get("key_id") or None,
        model=params.get("model") or None,
        since=_query_time(params, "since"),
        until=_query_time(params, "until"),
    )


def _query_time(params: admin.Params, name: str) -> float | None:
    value = params.get(name) or None
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return admin.parse_time({name: value}, name)


def priced(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Store rows with their cost as an exact decimal USD string."""
    return [{**{k: v for k, v in r.items() if k != "cost_nano"}, "cost": nano_to_usd_str(r["cost_nano"])}
            for r in rows]


async def summary(gw: Gateway, body: dict[str, Any], params: admin.Params) -> Any:
    query = usage_query(params)
    await gw.ledger.settled()
    rows = await gw.accounts.store.usage_summary(query)
    return {"object": "list", "by": list(query.by), "data": priced(rows)}


async def summary_csv(gw: Gateway, body: dict[str, Any], params: admin.Params) -> Response:
    query = usage_query(params)
    await gw.ledger.settled()
    rows = priced(await gw.accounts.store.usage_summary(query))
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    columns = [*query.columns(), *USAGE_TOTALS[:-1], "cost"]
    writer.writerow(columns)
    writer.writerows([row[c] for c in columns] for row in rows)
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8",
                    headers={"Content-Disposition": 'attachment; filename="kiln-usage.csv"'})


routes = [
    Route("/v1/generation", generation, methods=["GET"]),
    Route("/admin/v1/usage/summary", admin.endpoint(summary), methods=["GET"]),
    Route("/admin/v1/usage/summary.csv", admin.endpoint(summary_csv), methods=["GET"]),
]

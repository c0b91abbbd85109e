"""POST /v1/messages/count_tokens: the exact prompt size, from the backend's own tokenizer.

The request is converted exactly as POST /v1/messages would convert it
(system, tools, thinking switch: the chat template renders all of them),
then counted by the backend's tokenizer through its chat template (vLLM and
SGLang `/tokenize`, messages form). Runs no inference and is not billed: no
usage event, no generation id. It is authenticated and rate-limited by its own
per-minute window (no money, no in-flight slot: it runs no inference). Only if no backend
can count does Kiln estimate, and says so in the log.
"""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import Any

import aiohttp
import orjson
from starlette.requests import Request
from starlette.responses import Response

from kiln.catalog import Model
from kiln.core.admission import Demand
from kiln.core.errors import GatewayError
from kiln.pipeline import Gateway
from kiln.protocols.base import JSON
from kiln.protocols.anthropic.messages import MessagesTranslator

log = logging.getLogger("kiln.messages")

_COUNT = Demand(prompt_tokens_max=0, input_nano_per_token=Decimal(0), output_nano_per_token=Decimal(0),
                max_output_tokens=0, stream=False, endpoint="messages.count_tokens", kind="count")
_TEMPLATE_KEYS = ("tools", "chat_template_kwargs", "continue_final_message", "add_generation_prompt")


async def count_tokens(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    tr = MessagesTranslator(gw.catalog)
    try:
        key, _, body = await gw.intake(request)
        chat = tr.prompt(body)
        if gw.maintenance.active:
            raise gw.maintenance.error()
        await gw.admission.admit(key, gw.accounts.org(key.org_id), _COUNT)
    except GatewayError as err:
        reply = tr.error(err)
        return Response(reply.body, status_code=reply.status, media_type=reply.media_type, headers=reply.headers)
    count = await _count(gw, tr.model, chat)
    if count is None:
        count = tr.prompt_estimate
        log.warning("count_tokens for %s is an estimate: no backend tokenizer answered", tr.model.id)
    return Response(orjson.dumps({"input_tokens": count}), media_type=JSON)


async def _count(gw: Gateway, model: Model, chat: dict[str, Any]) -> int | None:
    """The backend tokenizer's count of the rendered prompt; None if no backend could give one."""
    payload = {"messages": chat["messages"], "add_generation_prompt": True}
    payload.update((k, chat[k]) for k in _TEMPLATE_KEYS if k in chat)
    try:
        backends = gw.router.candidates(model)
    except GatewayError:
        return None
    for backend in backends:
        url = backend.url.removesuffix("/v1") + "/tokenize"
        try:
            result = await gw.upstream.post_json(backend, url, {**payload, "model": backend.model})
        except (aiohttp.ClientConnectionError, OSError) as exc:
            log.info("count_tokens: backend %s unreachable (%s)", backend.url, type(exc).__name__)
            gw.router.failed(backend)
            continue
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.info("count_tokens: backend %s cannot tokenize messages (%s)", backend.url, exc)
            continue
        count = result.get("count") if isinstance(result, dict) else None
        if isinstance(count, int) and not isinstance(count, bool):
            return count
    return None

"""POST /v1/messages/count_tokens: the exact prompt size, from the backend's own tokenizer.

The request is converted exactly as POST /v1/messages would convert it
(system, tools, thinking switch: the chat template renders all of them), so
the count is the prompt a generation would see; the pipeline then asks a
backend's tokenizer (kiln/tokenizer.py) instead of generating. It runs no
inference and is not billed: no usage event, no generation id, no in-flight
slot, its own per-minute window in admission.
"""

from __future__ import annotations

from typing import Any

import orjson

from kiln.core.records import Usage
from kiln.protocols.anthropic.messages import MessagesTranslator
from kiln.protocols.base import UpstreamCall, prompt_of

class CountTokensTranslator(MessagesTranslator):
    endpoint = "messages.count_tokens"

    def request(self, body: Any) -> UpstreamCall:
        model, mapped = self.prompt(body)
        chat = mapped.chat
        tokenize = {"add_generation_prompt": True, **prompt_of(chat)}
        return UpstreamCall(model, "/tokenize", chat, False, 0, tokenize=tokenize, kind="count")

    def render(self, usage: Usage, cost_nano: int) -> bytes:
        return orjson.dumps({"input_tokens": usage.prompt_tokens})

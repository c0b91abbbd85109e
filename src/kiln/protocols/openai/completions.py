"""OpenAI legacy Completions: text that continues a prompt.

Forwarded to the backend's /v1/completions with chat's rules where they
apply (protocols/openai/passthrough.py). Specific to completions:
`max_tokens` defaults to 16 and is sent explicitly so every backend agrees;
the backend generates one completion per prompt and per `n`, and admission
reserves for all of them; `suffix` (insertion) is refused because vLLM
rejects it anyway; with `echo`, the prompt at the head of a choice's text is
never matched against stop strings.
"""

from __future__ import annotations

from typing import Any

from kiln.core import errors
from kiln.protocols.base import Context, UpstreamCall, as_bool, positive_int
from kiln.protocols.chat_backed import lookup_model
from kiln.protocols.openai.passthrough import Passthrough
from kiln.protocols.stop import StopMatcher, cut_at_stop, parse_stop

DEFAULT_MAX_TOKENS = 16


class CompletionsTranslator(Passthrough):
    endpoint = "completions"
    chunk_object = "text_completion"
    empty_piece = (b'"text":""',)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.stops: list[str] = []
        self._heads: list[int | None] = []  # per choice: echoed prompt length (None: unknown)
        self._matchers: dict[int, StopMatcher] = {}

    # -- request ----------------------------------------------------------

    def request(self, body: Any) -> UpstreamCall:
        model, self.name = lookup_model(self.ctx, body)
        body.pop("model")
        prompts = _prompts(body.get("prompt"))
        stream = self._stream_options(body)
        limit = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if limit is None:
            limit = DEFAULT_MAX_TOKENS
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise errors.invalid("'max_tokens' must be a non-negative integer.", param="max_tokens")
        body["max_tokens"] = cap = min(limit, model.max_output_tokens)
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not positive_int(n):
            raise errors.invalid("'n' must be a positive integer.", param="n")
        echo = as_bool(body.get("echo", False))
        if echo is None:
            raise errors.invalid("'echo' must be a boolean (true or false).", param="echo")
        body["echo"] = echo
        logprobs = body.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise errors.invalid("'logprobs' must be a non-negative integer (the number of top tokens).",
                                 param="logprobs")
        suffix = body.pop("suffix", None)
        if suffix is not None and not isinstance(suffix, str):
            raise errors.invalid("'suffix' must be a string.", param="suffix")
        if suffix:
            raise errors.invalid(f"'suffix' (insertion) is not supported on {model.id}: the serving stack cannot "
                                 "complete between a prompt and a suffix.",
                                 param="suffix", code="unsupported_parameter")
        self.stops = parse_stop(body.get("stop"))
        if self.stops and stream:
            # Cumulative usage on every chunk keeps billing exact when Kiln cuts the stream early.
            body["stream_options"]["continuous_usage_stats"] = True
        # vLLM numbers choices prompt by prompt: index = prompt_index * n + k.
        self._heads = [(len(p) if isinstance(p, str) else None) if echo else 0 for p in prompts for _ in range(n)]
        return UpstreamCall(model, "/completions", body, stream, cap, outputs=len(prompts) * n,
                            tokenize={"prompt": body["prompt"]})

    # -- JSON answer ----------------------------------------------------------

    def _enforce_json(self, data: dict[str, Any]) -> None:
        if not self.stops:
            return
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            head = self._head(choice.get("index", 0))
            if head is not None and isinstance(choice.get("text"), str):
                tail, hit = cut_at_stop(choice["text"][head:], self.stops)
                if hit is not None:
                    choice["text"] = choice["text"][:head] + tail
                    choice["finish_reason"], choice["stop_reason"] = "stop", hit
                    _trim_logprobs(choice.get("logprobs"), len(choice["text"]))

    # -- stream -----------------------------------------------------------

    def _parses(self) -> bool:
        return bool(self.stops)

    def _enforce(self, data: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """Stop strings: hold back what could still become one, cut where one appears."""
        keep = []
        for choice in data["choices"]:
            index = choice.get("index", 0)
            index = index if isinstance(index, int) else 0
            matcher = self._matchers.setdefault(index, StopMatcher(self.stops))
            if matcher.matched is not None:
                continue
            text = choice.get("text") if isinstance(choice.get("text"), str) else ""
            head = self._head(index)
            if head is not None:  # None: an echoed token prompt of unknown length; the backend's stop applies
                if 0 <= index < len(self._heads):
                    self._heads[index] = max(head - len(text), 0)  # the echoed prompt still to pass
                text = text[:head] + matcher.feed(text[head:])
                if matcher.matched is not None:
                    choice["finish_reason"], choice["stop_reason"] = "stop", matcher.matched
                elif choice.get("finish_reason") is not None:
                    text += matcher.flush()
            choice["text"] = text
            if text or choice.get("finish_reason") is not None:
                keep.append(choice)
        # every choice hit a stop string: stop reading (and the backend generating)
        ended = all(i in self._matchers and self._matchers[i].matched is not None for i in range(len(self._heads)))
        return keep, ended

    def _head(self, index: Any) -> int | None:
        """Characters of echoed prompt still ahead in choice `index`'s text (None: unknown)."""
        return self._heads[index] if isinstance(index, int) and 0 <= index < len(self._heads) else 0

    def truncate(self, note: str) -> bytes:
        choices = [{"index": i, "text": "", "logprobs": None, "finish_reason": "length"}
                   for i in range(len(self._heads) or 1)]
        return self._truncated(choices, note)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompt as a list of texts or token-id lists: str | [str] | [int] | [[int]]."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return list(prompt)
    if prompt is None or prompt == []:
        raise errors.invalid("Invalid 'prompt': send a string, an array of strings or token ids.",
                             param="prompt", code="empty_array" if prompt == [] else None)
    raise errors.invalid("'prompt' must be a string, an array of strings, an array of token ids "
                         "or an array of token-id arrays.", param="prompt")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _trim_logprobs(logprobs: Any, length: int) -> None:
    """Drop the logprobs of tokens that start after the cut text."""
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("text_offset"), list):
        return
    keep = sum(1 for offset in logprobs["text_offset"] if isinstance(offset, int) and offset < length)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        if isinstance(logprobs.get(key), list):
            logprobs[key] = logprobs[key][:keep]

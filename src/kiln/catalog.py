"""The model catalog: what Kiln serves, where, at what price, with which abilities.

Built once from configuration. A model has a public id, optional aliases
(e.g. a Claude or GPT name mapped onto a served model) and one or more
backends. Each backend carries its health (kiln.health), so `GET /v1/models`
and the router agree on what can be served right now.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kiln.core.money import Prices
from kiln.health import DOWN, BackendState

TOOL_CHOICE_MODES = ("auto", "none", "required", "named")
# Codex takes a catalog entry's instructions as its system prompt and drops an entry without them.
CODEX_INSTRUCTIONS = """You are a coding agent working in the user's terminal through Codex CLI. \
The model behind you is self-hosted and served by Kiln.

- Work in the current workspace. Inspect files and run commands with the shell tool; prefer fast tools such as `rg`.
- Edit files with the `apply_patch` tool: a patch starts with `*** Begin Patch`, adds, deletes or updates files, \
and ends with `*** End Patch`.
- Make the smallest change that solves the task, keep the existing style, and verify it (tests, builds) when you can.
- Never run destructive commands (such as `git reset --hard`, or deleting files you did not create) unless asked.
- When you are done, reply with a short summary of what you changed and what is left to do."""


BACKEND_KINDS = ("vllm", "sglang", "llamacpp", "openai")
DEFAULT_MAX_IN_FLIGHT = 1024  # per backend, and the size of its connection pool


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long Kiln waits on a backend before it counts as failing (seconds).

    Chosen for LLM serving, where a long prefill is normal and not a failure:

    - connect_s: the TCP (and TLS) connection. Model servers sit on the same
      network; 5 s without a connection means the host is gone.
    - headers_s: streams only, from sending the request to the response
      headers. vLLM, SGLang and llama.cpp send those before the prefill, so
      this covers tokenisation and fetching images, not the prompt's length;
      120 s leaves room for a slow multimodal fetch. A non-streaming answer
      has its headers only when generation is done, so it is bounded by the
      gateway's request_timeout_s instead (and by the health checks: a backend
      that goes down has its waiting requests moved to another one).
    - idle_s: streams only, the longest silence between two reads, including
      the one before the first token (queueing plus prefill of a long prompt
      on a busy server): 600 s.
    """

    connect_s: float = 5.0
    headers_s: float = 120.0
    idle_s: float = 600.0


@dataclass(slots=True, eq=False)  # compared and hashed by identity: one object per configured backend
class Backend:
    url: str  # base URL including /v1, no trailing slash
    model: str  # the model name the server knows
    api_key: str | None = None
    weight: int = 1  # share of traffic relative to the model's other backends
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    timeouts: Timeouts = field(default_factory=Timeouts)
    kind: str = ""  # vllm | sglang | llamacpp | openai (kiln.backends); "": detected at the first health check
    state: BackendState = field(default_factory=BackendState)

    def __post_init__(self) -> None:
        self.state.label = f"{self.url} ({self.model})"

    @property
    def available(self) -> bool:
        """Reachable: healthy, or ejected (which the router still uses when nothing else is left)."""
        return self.state.status != DOWN


@dataclass(frozen=True, slots=True)
class Capabilities:
    image_input: bool = False
    tool_choice: frozenset[str] = frozenset({"auto", "none"})
    parallel_tool_calls: bool = False
    reasoning: bool = False
    response_format: bool = False


@dataclass(slots=True)
class Model:
    id: str
    backends: list[Backend]
    prices: Prices
    context_window: int
    max_output_tokens: int
    capabilities: Capabilities = field(default_factory=Capabilities)
    family: str = ""
    aliases: tuple[str, ...] = ()
    owned_by: str = "kiln"
    simulated: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def available(self) -> bool:
        return any(b.available for b in self.backends)

    def listing(self) -> dict[str, object]:
        """The `GET /v1/models` entry, with the metadata clients look for."""
        caps = self.capabilities
        return {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": "kiln (simulated)" if self.simulated else self.owned_by,
            "context_window": self.context_window,
            "max_output_tokens": self.max_output_tokens,
            "aliases": list(self.aliases),
            "kiln_capabilities": {  # not "capabilities": Anthropic's model object has its own
                "image_input": caps.image_input,
                "tool_choice": sorted(caps.tool_choice),
                "parallel_tool_calls": caps.parallel_tool_calls,
                "reasoning": caps.reasoning,
                "response_format": caps.response_format,
            },
            "pricing": {
                "input": str(self.prices.input),
                "cached_input": str(self.prices.cached_input),
                "output": str(self.prices.output),
                "unit": "USD per 1M tokens",
            },
            "simulated": self.simulated,
        }

    def codex_listing(self, slug: str, priority: int) -> dict[str, object]:
        """Codex's `ModelInfo` for this model under `slug`, for the `models` array of `GET /v1/models`.

        Codex (with `model_catalog_url`) reads `{"models": [ModelInfo]}`; for a
        slug missing there it assumes a 272k context (so it never compacts in
        time for a 32k model), no reasoning levels and no freeform apply_patch.
        Field names and values follow the catalog bundled in codex-cli 0.171.0,
        which rejects an entry without instructions.
        """
        caps = self.capabilities
        levels = ("low", "medium", "high") if caps.reasoning else ()
        return {
            "slug": slug,
            "display_name": slug,
            "description": f"{self.id} via Kiln" + (" (simulated)" if self.simulated else ""),
            "default_reasoning_level": "medium" if levels else None,
            "supported_reasoning_levels": [{"effort": e, "description": f"{e} reasoning effort"} for e in levels],
            "shell_type": "shell_command",
            "visibility": "list",
            "supported_in_api": True,
            "priority": priority,
            "base_instructions": CODEX_INSTRUCTIONS,
            "availability_nux": None,
            "upgrade": None,
            "additional_speed_tiers": [],
            "service_tiers": [],
            "default_service_tier": None,
            "supports_reasoning_summaries": caps.reasoning,
            "supports_reasoning_summary_parameter": caps.reasoning,
            "default_reasoning_summary": "auto" if caps.reasoning else "none",
            "support_verbosity": False,
            "default_verbosity": None,
            "apply_patch_tool_type": "freeform",
            "web_search_tool_type": "text",
            "truncation_policy": {"mode": "tokens", "limit": 10000},
            "supports_parallel_tool_calls": caps.parallel_tool_calls,
            "supports_image_detail_original": False,
            "context_window": self.context_window,
            "max_context_window": self.context_window,
            "auto_compact_token_limit": None,
            "effective_context_window_percent": 95,
            "experimental_supported_tools": [],
            "input_modalities": ["text", "image"] if caps.image_input else ["text"],
            "supports_search_tool": False,
            "use_responses_lite": False,
            "include_skills_usage_instructions": True,
            "tool_mode": None,
            "multi_agent_version": None,
        }


class Catalog:
    def __init__(self, models: list[Model]) -> None:
        self.models = models
        self._by_name: dict[str, Model] = {}
        for model in models:
            for name in (model.id, *model.aliases):
                if name in self._by_name:
                    raise ValueError(f"model name {name!r} is used twice in the catalog")
                self._by_name[name] = model

    def get(self, name: str) -> Model | None:
        return self._by_name.get(name)

    def available(self) -> list[Model]:
        return [m for m in self.models if m.available]

    def backends(self) -> list[Backend]:
        return [b for m in self.models for b in m.backends]

"""Runtime settings of the simulator, shared by the CLI, the app and /sim/config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SimSettings:
    """Everything that shapes the simulator's behaviour.

    Field names match the CLI flags with underscores so that ``POST /sim/config``
    can flip modes at runtime with the same vocabulary tests use on the command line.
    """

    host: str = "127.0.0.1"
    port: int = 8100
    models: list[str] = field(default_factory=lambda: ["demo-model"])
    max_model_len: int = 32768
    ttft_ms: float = 0.0
    token_delay_ms: float = 0.0
    # simulated prefill: this many µs per prompt token not served from the prefix cache, before the
    # first token (added to ttft_ms); makes cache-aware routing measurable
    prefill_us_per_token: float = 0.0
    id: str = ""  # names this server in the `x-sim-id` header and /sim/stats (default: host:port)
    seed: int = 0
    reply_tokens: int = 24
    reasoning_models: list[str] = field(default_factory=list)
    reasoning_field: str = "reasoning"
    ignore_stop: bool = False
    forced_tool_choice_fails: bool = False
    legacy_length_check: bool = False
    no_prompt_tokens_details: bool = False
    api_key: str | None = None
    # [{"when": str, "sim": {...}}]: a request without its own `sim` object whose latest turn
    # contains `when` behaves as if it carried that `sim` (drives clients that cannot send one)
    rules: list[dict[str, Any]] = field(default_factory=list)

    def for_request(self, sim: dict[str, Any]) -> "SimSettings":
        """These settings with the per-request overrides a request's `sim` object names
        (REQUEST_SETTINGS), so tests can set a quirk for one request instead of for everyone."""
        overrides = {k: sim[k] for k in REQUEST_SETTINGS if k in sim}
        if not overrides:
            return self
        try:
            return dataclasses.replace(self, **{k: _coerce(k, v) for k, v in overrides.items()})
        except ValueError:
            return self  # a bad override is ignored: the request is still served

    def add_rule(self, rule: Any) -> None:
        """Append one rule (newest first wins), keeping the last MAX_RULES: safe for concurrent tests."""
        self.rules = [*_rules([rule]), *self.rules][:MAX_RULES]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able view, returned by /sim/config."""
        return dataclasses.asdict(self)

    def merge(self, patch: dict[str, Any]) -> None:
        """Apply a /sim/config patch in place; raise ValueError on bad keys/values.

        Validates everything before mutating so a bad patch leaves settings untouched.
        """
        updates: dict[str, Any] = {}
        for key, value in patch.items():
            name = "models" if key == "model" else key
            if name in _READ_ONLY:
                raise ValueError(f"setting `{key}` cannot be changed at runtime")
            if name not in _FIELDS:
                raise ValueError(f"unknown setting `{key}`")
            updates[name] = _coerce(name, value)
        for name, value in updates.items():
            setattr(self, name, value)


_READ_ONLY = {"host", "port"}
# Settings a request's `sim` object may override for itself.
REQUEST_SETTINGS = ("ignore_stop", "legacy_length_check", "no_prompt_tokens_details", "forced_tool_choice_fails",
                    "reasoning_field")
MAX_RULES = 200
_FIELDS = {f.name for f in dataclasses.fields(SimSettings)}
_BOOLS = {"ignore_stop", "forced_tool_choice_fails", "legacy_length_check", "no_prompt_tokens_details"}
_INTS = {"max_model_len", "seed", "reply_tokens"}
_FLOATS = {"ttft_ms", "token_delay_ms", "prefill_us_per_token"}
_LISTS = {"models", "reasoning_models"}


def _coerce(name: str, value: Any) -> Any:
    """Check/convert one setting value to the field's type."""
    if name in _BOOLS:
        if not isinstance(value, bool):
            raise ValueError(f"`{name}` must be a boolean")
        return value
    if name in _INTS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"`{name}` must be an integer")
        return value
    if name in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"`{name}` must be a non-negative number")
        return float(value)
    if name in _LISTS:
        return split_names(value)
    if name == "reasoning_field":
        if value not in ("reasoning", "reasoning_content"):
            raise ValueError("`reasoning_field` must be 'reasoning' or 'reasoning_content'")
        return value
    if name == "rules":
        return _rules(value)
    if name == "id":
        if not isinstance(value, str):
            raise ValueError("`id` must be a string")
        return value
    if name == "api_key":
        if value is not None and not isinstance(value, str):
            raise ValueError("`api_key` must be a string or null")
        return value or None
    return value


def _rules(value: Any) -> list[dict[str, Any]]:
    """Check a `rules` list: objects with a non-empty string `when` and an object `sim`."""
    if not isinstance(value, list) or not all(
        isinstance(r, dict) and isinstance(r.get("when"), str) and r["when"] and isinstance(r.get("sim"), dict)
        for r in value
    ):
        raise ValueError('`rules` must be a list of {"when": "text", "sim": {...}} objects')
    return [{"when": r["when"], "sim": r["sim"]} for r in value]


def split_names(value: Any) -> list[str]:
    """Accept ``"a,b"``, ``["a", "b"]`` or ``["a,b"]`` and return a clean name list."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ValueError("expected a string or a list of strings")
    return [name.strip() for item in items for name in item.split(",") if name.strip()]

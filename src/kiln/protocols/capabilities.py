"""What a model's serving stack can be asked for, checked once for every protocol.

The contract measured serving stacks that fail silently where a client
expects a hard guarantee: forced tool choice returns a plain 500 or empty
arguments, structured output returns empty content, `parallel_tool_calls:
false` is not applied, `ignore_eos` breaks gpt-oss. So Kiln either makes a
request work or refuses it with a clear 400 before it reaches the model: a
catalog entry says what each model applies (`capabilities`), and these
rules decide for Chat, Responses and Messages alike. Each protocol names the
parameter in its own words (`what`, `param`).
"""

from __future__ import annotations

from kiln.catalog import Model
from kiln.core import errors

UNSUPPORTED = "unsupported_parameter"


def require_tool_choice(model: Model, mode: str, what: str, param: str = "tool_choice") -> None:
    """mode: "auto" | "none" | "required" | "named". Forced modes only where the model applies them."""
    if mode not in model.capabilities.tool_choice:
        raise errors.invalid(
            f"Model '{model.id}' does not apply forced tool choice ({what}); send tool choice auto.",
            param=param, code=UNSUPPORTED,
        )


def require_structured_output(model: Model, what: str, param: str) -> None:
    if not model.capabilities.response_format:
        raise errors.invalid(
            f"Model '{model.id}' does not support structured output ({what}). "
            "Ask for JSON in the prompt and validate it in your client.",
            param=param, code=UNSUPPORTED,
        )


def require_image_input(model: Model, param: str) -> None:
    if not model.capabilities.image_input:
        raise errors.invalid(f"Model '{model.id}' does not accept image input; send text only.",
                             param=param, code="unsupported_content")


def parallel_tool_calls(model: Model, wanted: bool | None) -> tuple[bool | None, bool]:
    """(value to forward, or None to forward nothing; whether Kiln keeps only the first call).

    A model that applies the setting is told; on one that does not, asking
    for one call per reply is enforced by the gateway (it drops the rest).
    """
    if wanted is None:
        return None, False
    if model.capabilities.parallel_tool_calls:
        return wanted, False
    return None, wanted is False


def refuse_ignore_eos(model: Model) -> None:
    """gpt-oss never stops without its end token: ignore_eos would run to max_tokens every time."""
    if model.family == "gpt-oss":
        raise errors.invalid(f"'ignore_eos' is not supported on {model.id} (gpt-oss models).",
                             param="ignore_eos", code=UNSUPPORTED)

"""Errors the gateway raises, independent of any wire protocol.

A protocol translator renders a GatewayError in its own shape (OpenAI or
Anthropic); the pipeline only ever raises these.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class GatewayError(Exception):
    """A failure with the HTTP status and the OpenAI-style type/code/param it maps to.

    plain=True marks errors the contract sends as a plain-text body (502);
    failover=True marks a backend failure where nothing reached the model, so
    another backend may take the request; backend=True marks what the model
    server answered or did (as opposed to the gateway's own refusals), and
    `outcome` what a failure says about its health ("connect", "timeout",
    "error"; empty when it answered); `reason` says why admission refused
    (metrics: a closed set).
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    plain: bool = False
    failover: bool = False
    backend: bool = False
    outcome: str = ""
    reason: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)


def invalid(message: str, *, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, "invalid_request_error", code, param)


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "authentication_error", "invalid_api_key")


def forbidden(message: str, code: str = "key_inactive") -> GatewayError:
    return GatewayError(403, message, "permission_error", code)


def payment_required(message: str, code: str, reason: str | None = None) -> GatewayError:
    return GatewayError(402, message, "insufficient_quota", code, reason=reason)


def not_found(message: str, *, code: str | None = None, param: str | None = None) -> GatewayError:
    return GatewayError(404, message, "not_found_error", code, param)


def too_large(message: str) -> GatewayError:
    return GatewayError(413, message, "request_too_large", "request_too_large")


def rate_limited(message: str, headers: dict[str, str] | None = None, reason: str | None = None) -> GatewayError:
    return GatewayError(429, message, "rate_limit_error", "rate_limit_exceeded", headers=headers or {},
                        reason=reason)


def bad_gateway(message: str) -> GatewayError:
    return GatewayError(502, message, "api_error", None, plain=True)


def unavailable(message: str, headers: dict[str, str] | None = None) -> GatewayError:
    return GatewayError(503, message, "overloaded_error", "service_unavailable", headers=headers or {})


def timeout(message: str) -> GatewayError:
    return GatewayError(504, message, "timeout_error", "timeout")


def internal(message: str = "Internal error in the gateway.") -> GatewayError:
    """A defect in Kiln itself (logged with its traceback where it happened)."""
    return GatewayError(500, message, "api_error", "internal_error")

"""API keys: generation, hashing and parsing of the credential headers.

Keys are random, prefixed and shown once; only their SHA-256 is stored. A
key carries 256 bits of randomness, so a fast unsalted hash is safe and lets
the hot path find a key with one dictionary lookup.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "sk-kiln-"
ADMIN_PREFIX = "sk-kiln-admin-"
_DISPLAY_CHARS = 12


def new_key(prefix: str = KEY_PREFIX) -> str:
    """A fresh secret key: prefix + 43 url-safe characters (256 bits)."""
    return prefix + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    """The part of a key that may be shown in listings and logs."""
    return key[: len(KEY_PREFIX) + _DISPLAY_CHARS // 2] + "…"


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def bearer_token(authorization: str | None, x_api_key: str | None) -> tuple[str | None, str | None]:
    """Extract the key from the request headers, per the contract.

    Authorization wins when present and must be a Bearer token (no fallback
    to x-api-key); x-api-key is read only when Authorization is absent.
    Returns (token, problem) where problem explains a rejection.
    """
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None, "The Authorization header must be a Bearer token."
        token = token.strip()
        if not token:
            return None, "The Authorization header carries no API key."
        return token, None
    if x_api_key is not None:
        token = x_api_key.strip()
        return (token, None) if token else (None, "The x-api-key header is empty.")
    return None, "No API key provided. Send it as 'Authorization: Bearer <key>'."

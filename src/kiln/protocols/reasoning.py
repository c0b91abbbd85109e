"""Reasoning round trip for a stateless gateway: Responses' `encrypted_content`, Messages' signature.

Codex sends `store: false` and asks for `reasoning.encrypted_content`, then
echoes every reasoning item back on the next turn; Claude Code echoes every
thinking block with its `signature`, and with `display: "omitted"` never
sees the text. Kiln keeps no state, so the reasoning text itself travels in
the blob: zlib-compressed, prefixed
with an HMAC-SHA256 tag under a server secret. The tag makes the blob
tamper-evident: a forged, edited or foreign blob (another gateway, OpenAI)
fails verification and is ignored, and nothing is decompressed before the
tag checks out. The text is not confidential (Kiln also returns it in the
item's `content`), so no encryption is needed.

The secret: `KILN_REASONING_SECRET` when set (replicas behind one load
balancer must share it), otherwise 32 random bytes in `<data_dir>/reasoning.key`,
created on first use, so a single gateway needs no configuration and its
blobs survive restarts.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import zlib
from pathlib import Path

PREFIX = "kiln-rs1."
KEY_FILE = "reasoning.key"
_TAG = 32
_MAX_BLOB = 4 * 1024 * 1024  # characters; far above any real reasoning text


class ReasoningSeal:
    """Seals reasoning text into an opaque blob and opens only blobs it sealed."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def seal(self, text: str) -> str:
        body = zlib.compress(text.encode(), 6)
        tag = hmac.new(self._key, body, hashlib.sha256).digest()
        return PREFIX + base64.urlsafe_b64encode(tag + body).decode().rstrip("=")

    def open(self, blob: object) -> str | None:
        """The sealed text, or None for anything this gateway did not seal."""
        if not isinstance(blob, str) or not blob.startswith(PREFIX) or len(blob) > _MAX_BLOB:
            return None
        encoded = blob[len(PREFIX):]
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        except (ValueError, binascii.Error):
            return None
        tag, body = raw[:_TAG], raw[_TAG:]
        if len(tag) != _TAG or not hmac.compare_digest(tag, hmac.new(self._key, body, hashlib.sha256).digest()):
            return None
        try:
            return zlib.decompress(body).decode()
        except (zlib.error, UnicodeDecodeError):
            return None


@functools.lru_cache(maxsize=4)
def reasoning_key(secret: str | None, data_dir: Path) -> bytes:
    """The HMAC key: derived from the configured secret, else the data dir's key file."""
    if secret:
        return hashlib.sha256(b"kiln reasoning seal v1\0" + secret.encode()).digest()
    path = data_dir / KEY_FILE
    if not path.exists():
        # Write aside, then link into place: concurrent starters agree on one key, and no
        # reader ever sees a half-written file.
        data_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{KEY_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    key = path.read_bytes()
    if len(key) < 16:
        raise RuntimeError(f"{path} is too short to be a key; delete it to have a new one created")
    return key

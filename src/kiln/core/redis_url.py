"""Redis URLs: where Kiln reaches Redis, read once for the configuration's check and the client.

Three forms, as redis-py takes them: `redis://[[user]:password@]host[:port][/db]` (TCP),
`rediss://...` (TLS, verified against the system's CAs or the `ssl_ca_certs` file in the
query) and `unix://[[user]:password@]/path/to/redis.sock?db=N` (a socket file: on one
machine a round trip costs the kernel a third to a half less than loopback TCP). A password may
also come as `?password=`. Errors name what is wrong, never the URL: it may hold a password.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

FORMS = "redis://[[user]:password@]host[:port][/db], rediss://... (TLS) or unix://[[user]:password@]/path?db=N"


@dataclass(frozen=True)
class RedisAddress:
    host: str
    port: int
    path: str | None  # a socket file (unix://): host and port unused
    db: int
    username: str | None
    password: str | None
    tls: bool
    ca_file: str | None  # rediss://: the CA file to verify the server by, else the system's


def parse(url: str) -> RedisAddress:
    """The address `url` names; ValueError if it is not one of the three forms."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"expected {FORMS}; got a URL of scheme {parts.scheme!r}")
    query = parse_qs(parts.query)
    path = unquote(parts.path) if parts.scheme == "unix" else None
    if parts.scheme == "unix" and not path:
        raise ValueError(f"a unix:// URL needs the socket file's path ({FORMS})")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"the port is not a number ({FORMS})") from None
    if "db" in query:
        db = query["db"][-1]
    else:  # redis://host/N names it in the path; a socket file's path is the file
        db = parts.path.strip("/") if path is None else ""
    if not (db or "0").isdigit():
        raise ValueError(f"the database is not a number ({FORMS})")
    password = unquote(parts.password) if parts.password else query.get("password", [""])[-1]
    return RedisAddress(host=parts.hostname or "127.0.0.1", port=port, path=path, db=int(db or 0),
                        username=unquote(parts.username) if parts.username else None, password=password or None,
                        tls=parts.scheme == "rediss", ca_file=query.get("ssl_ca_certs", [None])[-1])

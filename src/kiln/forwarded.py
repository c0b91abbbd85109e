"""Which peers' X-Forwarded-Proto and X-Forwarded-For a connection believes, and what they say.

Behind a TLS-terminating proxy the gateway sees plain HTTP from the proxy's address; the proxy
reports the client's scheme and address in these headers. They are believed only from the
peers `FORWARDED_ALLOW_IPS` names (addresses, networks, or `*`; default 127.0.0.1 and ::1,
as uvicorn reads it), since anyone else could claim anything. The console reads the scheme
(its cookies are Secure over HTTPS, and a form's Origin must match).
"""

from __future__ import annotations

import ipaddress
from typing import Any


class Trusted:
    """The peers whose X-Forwarded-* headers are believed: addresses and networks, or `*`."""

    def __init__(self, spec: str) -> None:
        self.everyone = False
        self.hosts: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for item in (s.strip() for s in spec.split(",")):
            if item == "*":
                self.everyone = True
            elif item:
                network = _network(item) if "/" in item else None
                if network is None:
                    self.hosts.add(item)  # an address, or a literal such as a unix socket's name
                else:
                    self.networks.append(network)

    def __contains__(self, host: object) -> bool:
        if self.everyone or host in self.hosts:
            return True
        if not self.networks or not isinstance(host, str):
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    def apply(self, scope: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> None:
        """From a trusted peer's request `headers`: the scheme from X-Forwarded-Proto; the client
        from X-Forwarded-For, the nearest hop that is not itself a trusted proxy."""
        hops: list[str] = []
        for name, value in headers:
            if name == b"x-forwarded-proto":
                proto = value.decode("latin1").strip()
                if proto in ("http", "https"):
                    scope["scheme"] = proto
            elif name == b"x-forwarded-for":
                hops += [h.strip() for h in value.decode("latin1").split(",") if h.strip()]
        if not hops:
            return
        client = hops[0] if self.everyone else next((h for h in reversed(hops) if h not in self), hops[0])
        scope["client"] = (client, 0)


def _network(spec: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(spec)
    except ValueError:
        return None

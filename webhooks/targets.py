"""Where a webhook may go: an http(s) URL whose host resolves only to public addresses
(or to a network the deployment allows), so a tenant cannot point FairQueue at its own
internal services. Checked when a URL is set (submit, admin) and again at every send,
where the connection goes to the very address that was checked (no DNS rebinding).

Pure: reads settings and the resolver, imports no model (the tenants admin uses it too).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from fairqueue.conf import fq_settings

URL_MAX = 2000
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class TargetRefused(ValueError):
    """The URL is malformed, does not resolve, or reaches an address that is not allowed."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str  # path and query, what the request line carries
    address: str  # the checked address the connection goes to


def _allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    try:
        return [ipaddress.ip_network(n, strict=False) for n in fq_settings().WEBHOOKS.ALLOWED_NETWORKS]
    except ValueError as exc:
        raise TargetRefused(f"FAIRQUEUE_WEBHOOK_ALLOWED_NETWORKS is not a list of networks: {exc}") from None


def address_allowed(ip: IPAddress) -> bool:
    """Public unicast, or inside an allowed network."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in network for network in _allowed_networks()):
        return True
    return ip.is_global and not (ip.is_multicast or ip.is_unspecified or ip.is_reserved)


def target_parse(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of a well-formed http(s) URL; raises TargetRefused."""
    if not url or len(url) > URL_MAX:
        raise TargetRefused(f"The URL must be 1-{URL_MAX} characters.")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"Not a valid URL: {exc}.") from None
    if parts.scheme not in ("http", "https"):
        raise TargetRefused("The URL must start with https:// or http://.")
    if not parts.hostname:
        raise TargetRefused("The URL has no host.")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("The URL may not carry a user name or password.")
    if any(c in url for c in "\r\n\t "):
        raise TargetRefused("The URL may not contain spaces or control characters.")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path


def target_resolve(url: str) -> Target:
    """Check `url` and pick the address to connect to; raises TargetRefused.

    Every address the host resolves to must be allowed: a name that resolves to one
    public and one private address is refused, since a later lookup may return either.
    """
    scheme, host, port, path = target_parse(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise TargetRefused(f"The host {host!r} does not resolve ({exc}).") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise TargetRefused(f"The host {host!r} does not resolve.")
    for ip in addresses:
        if not address_allowed(ip):
            raise TargetRefused(
                f"The host {host!r} resolves to {ip}, a private, loopback, link-local or reserved address; "
                "webhooks go to public addresses only (FAIRQUEUE_WEBHOOK_ALLOWED_NETWORKS lists exceptions)."
            )
    return Target(scheme=scheme, host=host, port=port, path=path, address=str(addresses[0]))

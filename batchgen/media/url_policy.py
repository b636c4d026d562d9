"""URL policy for the fetch stage: parse once, refuse SSRF targets, pin the one address.

What is checked must be what is connected to: the URL is parsed by the parser the
connection uses (urllib3) and refused where Python's own parser reads it differently; the
host is resolved once and the connection is pinned to the address that passed.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import urllib3

from ..core.errors import RowError, describe, short

__all__ = ["Target", "parse_target", "check_url"]


def _resolve(host: str, port: int) -> list[str]:
    """Every address the host resolves to (tests patch this to fake public DNS)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


# IPv6 ranges that carry an IPv4 address in their low 32 bits: a private v4 hides in them.
_V4_IN_V6 = [
    ipaddress.ip_network(n)
    for n in ("::/96", "::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48")
]


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """IPv4 addresses an IPv6 address stands for: mapped, compatible, translated, NAT64,
    6to4 and Teredo forms."""
    found = [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
    if ip.teredo is not None:
        found += list(ip.teredo)
    if any(ip in net for net in _V4_IN_V6):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return found


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded:
            return all(v4.is_global and not v4.is_multicast for v4 in embedded)
    return ip.is_global and not ip.is_multicast


@dataclass(slots=True, frozen=True)
class Target:
    """An http(s) URL parsed once: what is checked is exactly what is connected to."""

    scheme: str
    host: str  # lower case, IDNA-encoded, IPv6 without brackets
    port: int
    path: str  # path and query, as sent in the request line
    host_header: str


_UNSAFE = re.compile(r"[\\\x00-\x20\x7f]")  # backslash, controls, space: parsers split on them differently


def parse_target(url: str) -> Target:
    """Parse with urllib3 (the connection's parser) and with urlsplit; refuse URLs on which
    they disagree, and the characters that make them disagree."""
    bad = _UNSAFE.search(url)
    if bad:
        raise RowError("fetch", f"{describe(url)}: refused: the URL holds {bad.group()!r}")
    try:
        ours = urllib3.util.parse_url(url)
        theirs = urlsplit(url)
        their_host = (theirs.hostname or "").encode("idna").decode("ascii").lower()
        their_port = theirs.port
    except (urllib3.exceptions.LocationParseError, ValueError, UnicodeError) as e:
        raise RowError("fetch", f"{describe(url)}: malformed URL ({short(e)})") from None
    scheme = (ours.scheme or "").lower()
    if scheme not in ("http", "https"):
        raise RowError("fetch", f"{describe(url)}: only http and https URLs are fetched")
    host = (ours.host or "").strip("[]").lower()
    if not host:
        raise RowError("fetch", f"{describe(url)}: URL without a host")
    if ours.auth is not None:
        raise RowError("fetch", f"{describe(url)}: refused: URLs with credentials (user@) are not fetched")
    if (host, ours.port) != (their_host, their_port) or ours.port == 0:
        raise RowError("fetch", f"{describe(url)}: refused: URL parsers disagree on its host or port")
    default = 443 if scheme == "https" else 80
    port = ours.port or default
    shown = f"[{host}]" if ":" in host else host
    header = shown if port == default else f"{shown}:{port}"
    return Target(scheme, host, port, ours.request_uri, header)


def check_url(url: str, allow_private: bool) -> tuple[Target, str]:
    """Refuse what the SSRF policy forbids; the target and the one address to connect to.

    The address is resolved here, once: the connection is pinned to it, so a DNS answer
    that changes between the check and the request (rebinding) changes nothing."""
    target = parse_target(url)
    host = target.host
    if not allow_private and (host == "localhost" or host.endswith(".localhost")):
        raise RowError(
            "fetch", f"{describe(url)}: refused: {host} is local (--allow-private-urls permits it)"
        )
    try:
        addresses = _resolve(host, target.port)
    except (OSError, UnicodeError, ValueError) as e:
        raise RowError("fetch", f"{describe(url)}: cannot resolve {host} ({short(e)})", transient=True) from e
    if not addresses:
        raise RowError("fetch", f"{describe(url)}: cannot resolve {host} (no address)")
    private = [a for a in addresses if not _is_public(a)]
    if private and not allow_private:
        raise RowError(
            "fetch",
            f"{describe(url)}: refused: {host} resolves to non-public address {', '.join(private)} "
            "(--allow-private-urls permits it)",
        )
    return target, addresses[0]

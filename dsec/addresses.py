"""The addresses a service advertises: where others reach it, as against where it listens.

A service bound to every address (`--host 0.0.0.0` or `::`) cannot tell others where to
reach it: "0.0.0.0" means "this machine" to whoever dials it, which is their own. It
says so with `--advertise-url`. The control plane refuses a node whose advertised URL no
one else can dial (`unroutable`), and one that advertises a loopback address while it
reports from another machine (`is_loopback`).
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address
from urllib.parse import urlsplit

SCHEMES = ("http", "https")


def _address(host: str) -> IPv4Address | IPv6Address | None:
    try:
        address = ip_address(host.strip("[]"))
    except ValueError:
        return None  # a host name
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    return address


def listens_everywhere(host: str) -> bool:
    """A bind host that stands for every address of the machine, and so for none."""
    address = _address(host) if host else None
    return not host or (address is not None and address.is_unspecified)


def unroutable(url: str) -> str | None:
    """Why no other machine can reach `url`'s host (None: it may): it names none, or an
    unspecified address (0.0.0.0, ::) or one that is no single host (multicast,
    broadcast). Only an http(s) URL's host is looked at here: the rest of its form is
    another check's."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return None
    if parts.scheme not in SCHEMES:
        return None
    if not host:
        return "which names no host"
    address = _address(host)
    if address is None:
        return None
    if address.is_unspecified:
        return f"and {host} is every address of its own machine, which is no address to another"
    if address.is_multicast or address == IPv4Address("255.255.255.255"):
        return f"and {host} names no single host"
    return None


def is_loopback(url: str) -> bool:
    """Whether `url`'s host is this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    host = (urlsplit(url).hostname or "").lower()
    address = _address(host)
    return host == "localhost" or (address is not None and address.is_loopback)


def is_loopback_address(host: str) -> bool:
    address = _address(host)
    return address is not None and address.is_loopback


def advertised_url(bound_url: str, advertise_url: str | None) -> str:
    """What a service tells others: `advertise_url` (with the bound port when it names
    none, so `--port 0` still works), or else the address it is bound to."""
    if advertise_url is None:
        return bound_url
    parts = urlsplit(advertise_url.rstrip("/"))
    if parts.port is not None:
        return f"{parts.scheme}://{parts.netloc}"
    bound_port = urlsplit(bound_url).port
    return f"{parts.scheme}://{parts.netloc}:{bound_port}"


def check_advertise_url(url: str) -> str:
    """A pydantic validator: an advertised URL others can dial (a scheme, a host others
    reach, a port or none), without a trailing slash."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a bad port raises)
    except ValueError as e:
        raise ValueError(f"{url!r} is not a URL: {e}") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{url!r} is not http:// or https://")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ValueError(f"{url!r} has more than a scheme, a host and a port")
    if (why := unroutable(url)) is not None:
        raise ValueError(f"{url!r} cannot be advertised, {why}")
    return url.rstrip("/")

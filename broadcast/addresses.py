"""Relay addresses: what a plain http://host:port is, and which hosts are private.

A tracker reached on a public address refuses private and loopback relay addresses (no one it serves could
reach them, and they would point other peers at their own machines); a tracker reached on a private or
loopback address (a lab, a LAN, one machine) accepts them. `allow_private` overrides either way.
"""

from __future__ import annotations

import ipaddress

from yarl import URL

MAX_URL_LEN = 255


def parse_relay_url(url: str) -> tuple[str, int]:
    """(host, port) of a plain http://host:port URL; ValueError with the reason otherwise."""
    if not isinstance(url, str) or len(url) > MAX_URL_LEN:
        raise ValueError(f"an address is at most {MAX_URL_LEN} characters")
    try:
        u = URL(url)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not a URL: {e}") from None
    if u.scheme != "http":
        raise ValueError("the scheme must be http://")
    if u.user is not None or u.password is not None or u.query_string or u.fragment:
        raise ValueError("no user, query or fragment: a plain http://host:port")
    if u.path not in ("", "/"):
        raise ValueError("no path: a plain http://host:port")
    if not u.host or u.explicit_port is None or not 0 < u.explicit_port < 65536:
        raise ValueError("host and port are both needed: http://host:port")
    host = u.host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not all(part and len(part) < 64 and part.replace("-", "").isalnum() for part in host.split(".")):
            raise ValueError(f"{host!r} is neither an IP address nor a host name") from None
        return host, u.explicit_port
    if ip.is_unspecified or ip.is_multicast:
        raise ValueError(f"{host} is not an address one can connect to")
    return host, u.explicit_port


def relay_url(host: str, port: int) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"http://[{host}]:{port}"
    except ValueError:
        pass
    return f"http://{host}:{port}"


def is_private(host: str) -> bool:
    """Loopback, private, link-local or otherwise not globally routable (names: only localhost)."""
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_private or ip.is_loopback or ip.is_link_local or not ip.is_global


def is_wildcard(host: str | None) -> bool:
    return host in (None, "", "0.0.0.0", "::", "[::]")


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertised_url(relay: bool, url: str | None, port: int | None, observed: str, private_ok: bool) -> str | None:
    """The address a joining peer's relay is given to others at: the one it advertised, checked, or the host
    its join came from (`observed`) with its relay's bound port; None for a peer that serves no one.
    ValueError says why an address is refused."""
    if not relay:
        return None
    if url is not None:
        try:
            host, p = parse_relay_url(url)
        except ValueError as e:
            raise ValueError(f"advertised address {url[:80]!r} refused: {e}") from None
        if is_private(host) and not private_ok:
            raise ValueError(f"{url} is a private or loopback address and this tracker is not on one: "
                             "advertise an address others can reach (--advertise)")
        return relay_url(host, p)
    if port is None:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    return relay_url(observed, port)

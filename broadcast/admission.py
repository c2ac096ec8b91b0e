"""Joins budgeted by where they come from (sans-I/O): per source address, per address prefix (an IPv4 /24, an
IPv6 /64: what one operator typically holds), and per key. Keys with standing are not held to the prefix's
budget: a flood from their network must not keep them out (issue 29: 994 of 1,500 joins from many
addresses were accepted and the tracker was full for an honest newcomer)."""

from __future__ import annotations

import ipaddress

from .bans import TrackerError
from .buckets import KeyedBuckets
from .config import OriginConfig


def prefix(address: str) -> str:
    """The /24 (IPv4) or /64 (IPv6) an address is in; the address itself when it is no IP address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    bits = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class JoinGate:
    def __init__(self, cfg: OriginConfig):
        self.per_address = KeyedBuckets(*cfg.joins_per_address)
        self.per_prefix = KeyedBuckets(*cfg.joins_per_prefix)
        self.per_key = KeyedBuckets(*cfg.joins_per_key)

    def address(self, src: str, now: float) -> None:
        """Before the signature is checked: the source address's budget."""
        if wait := self.per_address.take(src, now):
            raise TrackerError(429, f"too many joins from {src}: retry in {wait:.1f}s", "rate_limited")

    def signed(self, src: str, key: str, ranked: bool, now: float) -> None:
        """Once the join's signature holds: its prefix's budget (not for keys with standing) and its key's."""
        if not ranked and (wait := self.per_prefix.take(prefix(src), now)):
            raise TrackerError(429, f"too many joins from {prefix(src)}: retry in {wait:.1f}s", "prefix_limited")
        if wait := self.per_key.take(key, now):
            raise TrackerError(429, f"too many joins by key {key[:16]}...: retry in {wait:.1f}s", "rate_limited")

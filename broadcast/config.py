"""The relay tree's knobs, owned here: one name per knob from the flag (or the trainer's `[server.tree]`
table) to the code that reads it.

`PeerConfig` is what a peer reads (`swarm node` and `swarm relay` flags: `--relay-host` is `relay_host`,
`--stall-timeout` is `stall_timeout`); `OriginConfig` is what the origin and its tracker read (the
trainer's `[server.tree]`). The simulator (bench/tree_sim.py) takes its defaults from the same structs.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MIN_FIRST_BYTE_S = 0.25  # the shortest first-byte timeout one may set
HOLD_SHARE = 0.6  # a relay holds a child's request for a piece on its way this share of its stall timeout


class PeerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    relay: bool = True  # serve other peers (--no-relay: download only)
    # Where the relay listens (None: 127.0.0.1 when the tracker is on loopback, else every interface).
    relay_host: str | None = None
    relay_port: int = 0  # 0: any free port
    # http://HOST:PORT others reach the relay at, when the tracker cannot see it (NAT, a forwarded port).
    advertise: str | None = None
    name: str = ""  # a label in the tracker's views
    keep: int = 3  # versions kept on disk
    upload_rate: float = 0.0  # bytes/s the relay may send (0: the link's own limit)
    window: int = 2  # requests in flight per tree: keeps a parent's pipe full across piece boundaries
    stall_timeout: float = 30.0  # seconds without progress before a source is reported and bypassed
    first_byte_timeout: float = 1.0  # seconds a source may stay silent before the next ancestor is asked too
    progress: bool = False  # progress bars

    def __post_init__(self) -> None:
        if self.window < 1 or self.keep < 1 or self.stall_timeout <= 0 or not 0 <= self.relay_port < 65536:
            raise ValueError(f"implausible peer config: {self}")
        if self.upload_rate < 0:
            raise ValueError("upload_rate must be positive (0: no limit)")
        self.first_byte_timeout = max(MIN_FIRST_BYTE_S, self.first_byte_timeout)

    @property
    def hold_s(self) -> float:
        """How long this relay holds a child's request for a piece still on its way to it."""
        return HOLD_SHARE * self.stall_timeout


class OriginConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    fanout: int = 4  # children per relay in each tree
    trees: int = 0  # 0: as many as fanout, which lets every relay upload exactly what it downloads
    # Piece size: a relay forwards each piece once verified. 0: chosen per version (about 512 pieces).
    piece_bytes: int = 1 << 20
    heartbeat_s: float = 2.0  # how often peers tell the tracker what they hold
    piece_wait_s: float = 20.0  # how long the origin holds a request for a piece it has not released yet
    max_peers: int = 1000  # members the tracker holds at once
    # May relays advertise private or loopback addresses (a lab, a LAN)? "auto": when the relay's join
    # reached the tracker on such an address itself.
    allow_private: Literal["auto", "always", "never"] = "auto"
    # Every full_every-th version goes out whole, the others as deltas against the version before
    # (broadcast/delta.py); a node without the base fetches the chain or the version whole. 1: all whole.
    # Measured on SmolLM2 (bench/delta.py): a bf16 delta is ~2% of the version, an fp32 one ~40%.
    full_every: int = 10
    upload_rate: float = 0.0  # bytes/s the origin may send (0: the link's own limit)
    joins_per_address: tuple[float, float] = (4.0, 64.0)  # joins accepted per source address: rate/s, burst
    joins_per_prefix: tuple[float, float] = (4.0, 128.0)  # per /24 or /64 (not for keys with standing)
    joins_per_key: tuple[float, float] = (0.2, 3.0)  # and per key
    # The share of max_peers kept for keys with standing (established by the trainer, or shown they upload):
    # fresh keys fill at most the rest, so a flood of them cannot keep an established node out.
    reserved_share: float = 0.2

    def __post_init__(self) -> None:
        if self.fanout < 1 or self.trees < 0 or self.piece_bytes < 0 or self.heartbeat_s <= 0:
            raise ValueError(f"implausible origin config: {self}")
        if self.max_peers < 1 or self.full_every < 1 or self.upload_rate < 0 or not 0 <= self.reserved_share < 1:
            raise ValueError("max_peers and full_every must be >= 1")

    @property
    def n_trees(self) -> int:
        return self.trees or self.fanout

    @property
    def private_ok(self) -> bool | None:
        """None: decide per join (the address it reached the tracker on)."""
        return {"auto": None, "always": True, "never": False}[self.allow_private]

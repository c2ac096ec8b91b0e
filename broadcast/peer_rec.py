"""The tracker's record of one member (sans-I/O data): who it is, where it relays, what it holds, and what
has been said of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .standing import uploaded


@dataclass
class PeerRec:
    peer_id: str
    token: str
    name: str
    url: str | None
    relay: bool
    seq: int
    key: str = ""
    group: int | None = None
    last_hb: float = 0.0  # when its last heartbeat (or its join) came
    complete: list[int] = field(default_factory=list)
    progress: dict[int, int] = field(default_factory=dict)
    strikes: int = 0
    reporters: dict[str, float] = field(default_factory=dict)  # vouching keys that reported it stalling: when
    demoted: bool = False
    reachable: bool | None = None
    reach_error: str = ""
    served_bytes: int = 0  # what it says it uploaded
    confirmed: dict[str, int] = field(default_factory=dict)  # child key (with standing) -> bytes received
    rechecked: float = 0.0  # when the origin last connected back to it (unreachable relays are re-checked)
    given: dict[str, float] = field(default_factory=dict)  # source URLs it was given: when last
    addr: str = ""  # the address its join came from: its parents tell its requests by it (uplink_share.py)

    @property
    def interior_capable(self) -> bool:
        return self.relay and self.url is not None and self.reachable is not False and not self.demoted

    @property
    def uploaded(self) -> int:
        return uploaded(self)

"""What the simulator's parts see of each other (swarm.Swarm puts them together): the world they live in,
and the little each asks of the others, so that none imports the whole."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Protocol

from broadcast.config import OriginConfig, PeerConfig
from broadcast.messages import PeerHeartbeat, Report, TreeSources
from broadcast.tracker import Tracker
from broadcast.turns import TurnQueue

from .engine import Host, Net, Sim


class Peer(Protocol):
    url: str
    host: Host

    def holds(self, version: int, index: int) -> bool: ...


class Pieces(Protocol):
    """fetch.Fetching: each piece's race, and the sources' side of requests."""

    def race(self, p, tree: int, index: int, failures: int) -> None: ...
    def serve(self, req) -> None: ...
    def cut(self, req) -> None: ...


class Origin(Protocol):
    """origin.SimOrigin: the tracker's door."""

    host: Host
    turns: TurnQueue
    tracker: Tracker

    def join(self, url: str, name: str, key: str, addr: str = "") -> tuple[str, str]: ...
    def heartbeat(self, msg: PeerHeartbeat, latest: int | None) -> TreeSources | None: ...
    def report(self, peer_id: str, r: Report, answered: Callable[[str], None]) -> None: ...


class World(Protocol):
    sim: Sim
    net: Net
    origin_cfg: OriginConfig
    peer_cfg: PeerConfig
    trees: int
    report_uploads: bool
    trusted: bool  # peers join as keys the trainer trusts, or as strangers
    peers: dict[str, Peer]
    origin: Origin
    fetch: Pieces
    latest: int
    sizes: dict[int, int]
    pending: int
    reports: collections.Counter[str]
    on_all_done: Callable[[], None] | None

    def lat(self, a, b) -> float: ...
    def to_origin(self, p) -> float: ...
    def n_pieces(self, v: int) -> int: ...
    def piece_size(self, v: int, i: int) -> int: ...
    def join(self, p) -> None: ...

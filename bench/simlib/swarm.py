"""A swarm in simulated time: peers (peers.py, fetch.py) and the origin (origin.py) driving the relay tree's
real decision code (broadcast/: the tracker, the verdicts, the uplink plan, each peer's SourceBook and
PieceRace, the turns) on the links of engine.py. Nothing here decides what the tree does: it only says
when a message arrives and how fast bytes flow (docs/tree-simulation.md states the model).
"""

from __future__ import annotations

import collections

from broadcast.config import OriginConfig, PeerConfig

from .engine import Host, Net, Sim
from .fetch import Fetching
from .origin import SimOrigin
from .peers import SimPeer

__all__ = ["SimPeer", "Swarm"]


class Swarm:
    def __init__(self, sim: Sim, origin: Host, origin_cfg: OriginConfig, peer_cfg: PeerConfig, piece: int,
                 report_uploads: bool = True, probes: bool = True, seed: str = "", trusted: bool = True):
        """`report_uploads`: peers tell the tracker what they received (False: placement has no evidence);
        `probes`: the origin times relays' uplinks (broadcast/uplink_plan.py); `seed`: the tracker's peer ids
        and its layout's order among equals are drawn from it (the same seed, the same run); `trusted`: peers
        join as keys the trainer trusts (established nodes), or as strangers who earn standing as the tree's
        rules say."""
        self.sim, self.net = sim, Net(sim)
        self.origin_cfg, self.peer_cfg = origin_cfg, peer_cfg
        self.trees, self.piece = origin_cfg.n_trees, piece
        self.report_uploads, self.trusted = report_uploads, trusted
        self.peers: dict[str, SimPeer] = {}  # by url
        self.origin = SimOrigin(self, origin, origin_cfg, probes, seed)
        self.fetch = Fetching(self)
        self.latest = 0
        self.sizes: dict[int, int] = {}
        self.pending = 0  # live peers that still lack the latest version
        self.reports: collections.Counter[str] = collections.Counter()
        self.on_all_done = None

    @property
    def tracker(self):
        return self.origin.tracker

    def lat(self, a: SimPeer, b: SimPeer) -> float:
        return a.host.lat + b.host.lat

    def to_origin(self, p: SimPeer) -> float:
        return p.host.lat + self.origin.host.lat

    def n_pieces(self, v: int) -> int:
        return -(-self.sizes[v] // self.piece)

    def piece_size(self, v: int, i: int) -> int:
        return min(self.piece, self.sizes[v] - i * self.piece)

    def new_peer(self, idx: int, host: Host) -> SimPeer:
        return SimPeer(idx, host, self)

    # -- membership -------------------------------------------------------------------------------------
    def arrive(self, p: SimPeer) -> None:
        self.peers[p.url] = p
        self.sim.after(self.to_origin(p), self.join, p)

    def join(self, p: SimPeer) -> None:
        if not p.host.alive:
            return
        p.pid, p.token = self.origin.join(p.url, f"p{p.idx}", f"sim-{p.idx}", p.host.name, p.relay)
        self.sim.after(self.to_origin(p), self._joined, p)

    def _joined(self, p: SimPeer) -> None:
        p.heartbeat(periodic=True)
        if self.latest and self.latest not in p.done_at:
            self.sim.after(2 * self.to_origin(p), p.begin, self.latest)

    def depart(self, p: SimPeer, graceful: bool) -> None:
        """graceful: Peer.stop() posts /leave; otherwise the process dies (connections reset, no leave)."""
        if not p.host.alive:
            return
        p.depart()
        if graceful and p.pid:
            self.sim.after(self.to_origin(p), self.origin.leave, p.pid)

    # -- a version ---------------------------------------------------------------------------------------
    def publish(self, v: int, size: int) -> None:
        self.latest = v
        self.sizes[v] = size
        for p in self.peers.values():
            if p.host.alive and p.pid:  # the long poll answers at once
                self.sim.after(2 * self.to_origin(p), p.begin, v)

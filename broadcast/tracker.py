"""Tracker state: membership, liveness, and each peer's place in the k trees (SplitStream layout).

Piece i travels down tree i mod k. Every relay peer is interior in exactly one tree (its `group`) and a leaf
in all the others, so each relay uploads about what it downloads: fanout f = k children x S/k bytes = S.
Within a tree the group forms an f-ary heap under the origin; every other peer hangs off a free slot,
shallowest first. Peers that can't relay (--no-relay, or demoted for being slow) are leaves everywhere.
"""

from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass, field

from .messages import Banned, Join, Joined, PeerHeartbeat, PeerView, Received, TreeSources, TreeView
from .placement import Candidate, UploadMeter, measured_layout


class TrackerError(Exception):
    def __init__(self, status: int, msg: str):
        super().__init__(msg)
        self.status = status


@dataclass
class PeerRec:
    peer_id: str
    token: str
    name: str
    url: str | None
    relay: bool
    seq: int
    group: int | None = None
    last_hb: float = field(default_factory=time.monotonic)
    complete: list[int] = field(default_factory=list)
    progress: dict[int, int] = field(default_factory=dict)
    strikes: int = 0
    reporters: set[str] = field(default_factory=set)
    demoted: bool = False

    @property
    def interior_capable(self) -> bool:
        return self.relay and self.url is not None and not self.demoted


class Tracker:
    def __init__(self, origin_url: str, trees: int, fanout: int, heartbeat_interval: float = 2.0):
        if trees < 1 or fanout < 1:
            raise ValueError("trees and fanout must be >= 1")
        self.origin_url = origin_url
        self.trees = trees
        self.fanout = fanout
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = 3 * heartbeat_interval + 1.0
        self.peers: dict[str, PeerRec] = {}
        self.banned: dict[str, Banned] = {}
        self.banned_urls: set[str] = set()
        self.events: collections.deque[str] = collections.deque(maxlen=200)
        self._seq = 0
        self._topo: tuple[list[dict[str, str | None]], list[dict[str | None, list[str]]]] | None = None
        self.uploads = UploadMeter()  # placement: children's reports of what each source uploaded

    # -- membership -------------------------------------------------------------------------------------
    def event(self, msg: str) -> None:
        self.events.append(f"{time.strftime('%H:%M:%S')} {msg}")

    def join(self, msg: Join) -> Joined:
        if msg.url is not None and msg.url in self.banned_urls:
            raise TrackerError(403, f"{msg.url} was removed for serving corrupt data")
        if msg.url is not None:
            for p in list(self.peers.values()):
                if p.url == msg.url:  # the same address rejoining (restart): the old record is stale
                    self.remove(p.peer_id, "rejoined")
        self._seq += 1
        rec = PeerRec(secrets.token_hex(8), secrets.token_hex(16), msg.name[:64], msg.url, msg.relay, self._seq)
        if rec.interior_capable:
            rec.group = self._smallest_group()
        self.peers[rec.peer_id] = rec
        self._topo = None
        self.event(f"join {rec.peer_id} {rec.name} {rec.url or '(no relay)'} group={rec.group}")
        return Joined(rec.peer_id, rec.token, self.trees, self.heartbeat_interval)

    def _group_sizes(self) -> list[int]:
        sizes = [0] * self.trees
        for p in self.peers.values():
            if p.group is not None:
                sizes[p.group] += 1
        return sizes

    def _smallest_group(self) -> int:
        sizes = self._group_sizes()
        return sizes.index(min(sizes))

    def _rebalance(self) -> None:
        """After a departure, move the newest member of the largest group to the smallest one."""
        while True:
            sizes = self._group_sizes()
            if max(sizes) - min(sizes) <= 1:
                return
            big, small = sizes.index(max(sizes)), sizes.index(min(sizes))
            mover = max((p for p in self.peers.values() if p.group == big), key=lambda p: p.seq)
            mover.group = small

    def auth(self, peer_id: str, token: str) -> PeerRec:
        if peer_id in self.banned:
            raise TrackerError(410, f"peer {peer_id} was removed: {self.banned[peer_id].reason}")
        rec = self.peers.get(peer_id)
        if rec is None:
            raise TrackerError(404, f"unknown peer {peer_id}; join again")
        if not secrets.compare_digest(rec.token, token):
            raise TrackerError(403, "bad token")
        return rec

    def heartbeat(self, msg: PeerHeartbeat, latest: int | None) -> TreeSources:
        rec = self.auth(msg.peer_id, msg.token)
        rec.last_hb = time.monotonic()
        rec.complete = sorted(msg.complete)[-64:]
        rec.progress = dict(list(msg.progress.items())[:64])
        self._note_uploads(rec, msg.received, latest)
        return TreeSources(latest, self.sources(rec.peer_id))

    def remove(self, peer_id: str, why: str) -> None:
        rec = self.peers.pop(peer_id, None)
        if rec is None:
            return
        self._topo = None
        if rec.group is not None:
            self._rebalance()
        self.event(f"remove {peer_id} {rec.name} ({why})")

    def ban(self, peer_id: str, reason: str, reporter: str) -> None:
        rec = self.peers.get(peer_id)
        url = rec.url if rec else None
        self.banned[peer_id] = Banned(peer_id, url, reason, reporter, time.time())
        if url:
            self.banned_urls.add(url)
        self.remove(peer_id, f"banned: {reason}")

    def demote(self, peer_id: str, why: str) -> None:
        rec = self.peers.get(peer_id)
        if rec and not rec.demoted:
            rec.demoted = True
            rec.group = None
            self._topo = None
            self._rebalance()
            self.event(f"demote {peer_id} to leaf ({why})")

    def reap(self) -> list[str]:
        now = time.monotonic()
        dead = [p.peer_id for p in self.peers.values() if now - p.last_hb > self.dead_after]
        for pid in dead:
            self.remove(pid, "heartbeat timeout")
        return dead

    def by_url(self, url: str) -> PeerRec | None:
        for p in self.peers.values():
            if p.url == url:
                return p
        return None

    # -- topology ---------------------------------------------------------------------------------------
    def topology(self) -> tuple[list[dict[str, str | None]], list[dict[str | None, list[str]]]]:
        """Per tree: parent of each peer (None = origin) and children of each node (None key = origin)."""
        if self._topo is not None:
            return self._topo
        if self.uploads.placed:
            self._topo = self._measured_topology()
            return self._topo
        parents: list[dict[str, str | None]] = []
        children: list[dict[str | None, list[str]]] = []
        ordered = sorted(self.peers.values(), key=lambda p: p.seq)
        for t in range(self.trees):
            par: dict[str, str | None] = {}
            kids: dict[str | None, list[str]] = collections.defaultdict(list)
            interior = [p.peer_id for p in ordered if p.group == t and p.interior_capable]
            for j, pid in enumerate(interior):
                parent = None if j == 0 else interior[(j - 1) // self.fanout]
                par[pid] = parent
                kids[parent].append(pid)
            slots = iter([pid for pid in interior for _ in range(self.fanout - len(kids[pid]))])
            for p in ordered:
                if p.peer_id in par:
                    continue
                parent = next(slots, None)  # None: no free slot left, the origin takes it
                par[p.peer_id] = parent
                kids[parent].append(p.peer_id)
            parents.append(par)
            children.append(dict(kids))
        self._topo = (parents, children)
        return self._topo

    # -- placement by measured uplink (broadcast/placement.py) -----------------------------------------------
    def _note_uploads(self, rec: PeerRec, received: dict[str, Received], latest: int | None) -> None:
        if latest is not None and latest != self.uploads.epoch:
            live = {p.url for p in self.peers.values() if p.url} | {self.origin_url}
            if self.uploads.new_epoch(latest, live):
                self._topo = None  # a new version: lay the trees out by what was measured
                for p in self.peers.values():
                    # A stall report blames the relay a child waited on, often the victim of a slow one above
                    # it; once uplinks are measured, the new layout decides again (a real staller re-earns it).
                    if p.demoted and p.url in self.uploads.placed:
                        p.demoted = False
                        p.reporters.clear()
        if received:
            self.uploads.note(received, time.monotonic())

    def _measured_topology(self) -> tuple[list[dict[str, str | None]], list[dict[str | None, list[str]]]]:
        ordered = sorted(self.peers.values(), key=lambda p: p.seq)
        placed = self.uploads.placed
        cands = [Candidate(p.peer_id, p.url, p.interior_capable, p.group, placed.get(p.url) if p.url else None)
                 for p in ordered]
        group, parents, children = measured_layout(cands, self.trees, self.fanout, placed.get(self.origin_url))
        for p in ordered:
            p.group = group[p.peer_id]
        return parents, children

    def sources(self, peer_id: str) -> list[list[str]]:
        """For each tree, the chain of ancestor URLs: parent first, origin last."""
        parents, _ = self.topology()
        out = []
        for t in range(self.trees):
            chain: list[str] = []
            cur = parents[t].get(peer_id)
            while cur is not None and len(chain) < 64:
                url = self.peers[cur].url
                if url:
                    chain.append(url)
                cur = parents[t].get(cur)
            chain.append(self.origin_url)
            out.append(chain)
        return out

    def view(self, latest: int | None, versions: list[int]) -> TreeView:
        parents, children = self.topology()
        now = time.monotonic()
        peers = [
            PeerView(
                p.peer_id,
                p.name,
                p.url,
                p.relay,
                p.group,
                p.complete,
                p.progress,
                round(now - p.last_hb, 2),
                p.strikes,
                [parents[t].get(p.peer_id) for t in range(self.trees)],
                [children[t].get(p.peer_id, []) for t in range(self.trees)],
            )
            for p in sorted(self.peers.values(), key=lambda p: p.seq)
        ]
        return TreeView(
            self.origin_url,
            self.trees,
            self.fanout,
            latest,
            versions,
            [children[t].get(None, []) for t in range(self.trees)],
            peers,
            list(self.banned.values()),
            list(self.events),
        )

"""The k trees a swarm's members sit in (sans-I/O): each relay's group (the tree it is interior in), the
layout (afresh when nothing is in flight, repaired in place while a version is: layout.py), placement by
measured uplinks (placement.py), and each member's sources. The tracker owns the members; it tells the
forest when they change.

Piece i travels down tree i mod k. Every relay peer is interior in exactly one tree (its `group`) and a leaf
in all the others, so each relay uploads about what it downloads: fanout f = k children x S/k bytes = S.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

from .layout import Layout, join_order_layout
from .messages import ORIGIN, Received
from .peer_rec import PeerRec
from .placement import Candidate, measured_layout
from .trials import Trials
from .upload_meter import UploadMeter

Parents = list[dict[str, str | None]]
Children = list[dict[str | None, list[str]]]


class Forest:
    def __init__(self, peers: dict[str, PeerRec], trees: int, fanout: int, tier: Callable[[PeerRec], int],
                 order_key: bytes | None = None):
        """`peers`: the tracker's members (shared, not copied); `tier`: 2 placed above the rest, 1 on trial
        (a few places low in the trees to earn standing in), 0 a leaf once uplinks are measured (tracker.tier);
        `order_key`: keys the order members are laid out in (None: a secret of this process's own; b"": the
        join order itself, for tests and simulated scenarios that put a chosen peer at the top)."""
        self.peers, self.k, self.fanout, self.tier = peers, trees, fanout, tier
        self.order_key = secrets.token_bytes(16) if order_key is None else order_key
        self.layout: Layout | None = None  # this version's trees; None: lay out afresh
        self.uploads = UploadMeter()  # placement: children's reports of what each source uploaded
        self.trials = Trials()  # relays on trial: keys earning standing (trials.py)
        self.latest: int | None = None  # the newest version, as the origin last said

    def ranked(self, rec: PeerRec) -> bool:
        return self.tier(rec) == 2

    def _ranked_id(self, peer_id: str | None) -> bool:
        rec = self.peers.get(peer_id) if peer_id is not None else None
        return rec is not None and self.ranked(rec)

    # -- the layout: afresh when nothing is in flight, repaired in place while a version is ---------------
    def in_flight(self) -> bool:
        return self.latest is not None and any(self.latest not in p.complete for p in self.peers.values())

    def relayout(self) -> None:
        """Something the layout depends on changed: lay out afresh, unless that would move peers mid-version."""
        if not self.in_flight():
            self.layout = None

    def repair(self, how: str, peer_id: str) -> None:
        """`how`: 'add', 'remove' or 'make_leaf' (layout.Layout's repairs)."""
        if self.layout is None or not self.in_flight():
            self.layout = None
        else:
            getattr(self.layout, how)(peer_id, self._ranked_id)

    # -- groups: the tree each relay is interior in --------------------------------------------------------
    def group_sizes(self) -> list[int]:
        sizes = [0] * self.k
        for p in self.peers.values():
            if p.group is not None:
                sizes[p.group] += 1
        return sizes

    def smallest_group(self) -> int:
        sizes = self.group_sizes()
        return sizes.index(min(sizes))

    def rebalance(self) -> None:
        """After a departure, move the newest member of the largest group to the smallest one."""
        while True:
            sizes = self.group_sizes()
            if max(sizes) - min(sizes) <= 1:
                return
            big, small = sizes.index(max(sizes)), sizes.index(min(sizes))
            mover = max((p for p in self.peers.values() if p.group == big), key=lambda p: p.seq)
            mover.group = small

    # -- topology -------------------------------------------------------------------------------------
    def topology(self) -> tuple[Parents, Children]:
        """Per tree: parent of each peer (None = origin) and children of each node (None key = origin)."""
        if self.layout is None:
            ordered = sorted(self.peers.values(), key=self._order)
            if self.uploads.placed or self.uploads.probed:
                self.layout = self._measured(ordered)
            else:
                self.layout = join_order_layout(
                    [(p.peer_id, p.group if p.interior_capable else None, self.tier(p)) for p in ordered],
                    self.k, self.fanout)
        return self.layout.topology()

    def _order(self, p: PeerRec) -> bytes:
        """Where a member comes among equals in the layout: a keyed hash of its join number, not the join
        order itself, so joining first buys no place above the fresh keys that join after (a handful of
        attacker keys that joined a new swarm first were its whole top: version 1 took 6.8x)."""
        seq = p.seq.to_bytes(8, "big")
        return hashlib.blake2b(seq, key=self.order_key, digest_size=8).digest() if self.order_key else seq

    # -- placement by measured uplink (broadcast/placement.py) -----------------------------------------------
    def note_uploads(self, rec: PeerRec, received: dict[str, Received], latest: int | None,
                     counts: bool = True, majority: bool = False) -> None:
        """`counts`: its figures count now; `majority`: nobody vouches (upload_meter.UploadMeter.note)."""
        if latest is not None and latest != self.latest:
            self.latest = latest
            self.layout = None  # a new version: a fresh layout, repaired in place until it is everywhere
        if latest is not None and latest != self.uploads.epoch:
            live = {p.url for p in self.peers.values() if p.url} | {ORIGIN}
            if self.uploads.new_epoch(latest, live):
                for p in self.peers.values():
                    # A stall report blames the relay a child waited on, often the victim of a slow one above
                    # it; once uplinks are measured, the new layout decides again (a real staller re-earns it).
                    if p.demoted and p.url in self.uploads.placed:
                        p.demoted = False
                        p.reporters.clear()
        self.uploads.note(received, rec.key, counts, majority)  # (nothing received: whether it counts, still)
        if majority and self.in_flight():  # the parents it has in this version: each relay's sample of children
            parents, _ = self.topology()
            self.uploads.note_parents(rec.key, {self.peers[q].url or "" for tree in parents
                                                if (q := tree.get(rec.peer_id)) is not None and q in self.peers})

    def probed(self, rec: PeerRec, rate: float) -> None:
        """The origin timed a download from this relay (broadcast/uplink_probe.py): the next layout uses it."""
        self.uploads.note_probe(rec.url or "", rate)
        self.relayout()

    def _measured(self, ordered: list[PeerRec]) -> Layout:
        """Peers with standing (or a measured uplink) are laid out by uplink; fresh keys are leaves in the
        spare places: they may not size the trees (24 fresh relays that never downloaded made the honest
        relays' tree nearly a star, and their versions 2.8x slower). A few relays on trial (trials.py) take
        places below the measured relays, where receivers who vouch can confirm what they send."""
        up = self.uploads
        sized = {p.peer_id for p in ordered if self.ranked(p) or p.url in up.placed}
        flying = self.latest if self.in_flight() else None
        self.trials.judge(self.peers, flying)
        trial = self.trials.pick(ordered, self.tier, self.group_sizes(), sized, self.latest)
        sized |= trial
        keep, fresh = [p for p in ordered if p.peer_id in sized], [p for p in ordered if p.peer_id not in sized]
        # A relay on trial is placed as one not measured yet, whatever the origin's probe said of it (the probe
        # times filler, which a key can serve fast and its children slowly: the attack lab's did, 300 MB/s).
        cands = [Candidate(p.peer_id, p.url, p.interior_capable, p.group,
                           None if p.peer_id in trial or not p.url else up.uplink(p.url), trial=p.peer_id in trial,
                           limit=up.limit(p.url or ""), low=up.majority and up.idle(p.url or ""))
                 for p in keep]
        group, parents, children, caps = measured_layout(cands, self.k, self.fanout,
                                                         up.placed.get(ORIGIN), len(fresh))
        for p in keep:
            p.group = group[p.peer_id]
        layout = Layout(parents, children, caps)
        for p in fresh:
            layout.add(p.peer_id, self._ranked_id)
        self.trials.started(trial, self.peers, lambda pid: any(
            self._ranked_id(c) for kids in layout.children for c in kids.get(pid, ())), flying)
        return layout

    def sources(self, peer_id: str) -> list[list[str]]:
        """For each tree, the chain of ancestor URLs, parent first; the origin above them is left out: each
        peer reaches it at its own tracker URL (the origin's bind address may be 0.0.0.0)."""
        parents, _ = self.topology()
        out = []
        for t in range(self.k):
            chain: list[str] = []
            cur = parents[t].get(peer_id)
            while cur is not None and len(chain) < 64:
                url = self.peers[cur].url
                if url:
                    chain.append(url)
                cur = parents[t].get(cur)
            out.append(chain)
        return out

"""Tracker state: keyed membership, standing, liveness, and each peer's place in the k trees (SplitStream).

Piece i travels down tree i mod k. Every relay peer is interior in exactly one tree (its `group`) and a leaf
in all the others, so each relay uploads about what it downloads: fanout f = k children x S/k bytes = S.
Within a tree the group forms an f-ary heap under the origin; every other peer hangs off a free slot,
shallowest first. Peers that can't relay (--no-relay, unreachable, or demoted) are leaves everywhere.

Identities are free, so a fresh key is trusted with nothing: members with standing (keys the trainer calls
established, and relays that have shown they upload) take the top of every tree and the first free slots;
fresh relays form a heap of their own below them, serving only other fresh peers, until they show they
upload. No fresh key ever sits between the origin and a peer with standing. Standing itself is
standing.py's; bans are bans.py's; the time is the clock given (sans-I/O: the origin passes the `time`
module, the simulator its own clock, so both drive this very object).
"""

from __future__ import annotations

import collections
import datetime
import secrets
from dataclasses import dataclass, field

from .bans import Bans, TrackerError
from .layout import Layout, join_order_layout
from .messages import ORIGIN, Join, Joined, PeerHeartbeat, PeerView, Received, TreeSources, TreeView
from .placement import Candidate, UploadMeter, measured_layout
from .standing import Clock, ManualClock, Standing, uploaded

__all__ = ["PeerRec", "Tracker", "TrackerError"]


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
    reporters: set[str] = field(default_factory=set)  # keys with standing that reported it stalling
    demoted: bool = False
    reachable: bool | None = None
    reach_error: str = ""
    served_bytes: int = 0  # what it says it uploaded
    confirmed: dict[str, int] = field(default_factory=dict)  # child key (with standing) -> bytes received
    rechecked: float = 0.0  # when the origin last connected back to it (unreachable relays are re-checked)

    @property
    def interior_capable(self) -> bool:
        return self.relay and self.url is not None and self.reachable is not False and not self.demoted

    @property
    def uploaded(self) -> int:
        return uploaded(self)


class Tracker:
    def __init__(self, origin_url: str, trees: int, fanout: int, heartbeat_s: float = 2.0, *,
                 clock: Clock | None = None, max_peers: int = 1000, penalty_limit: float = 5.0,
                 prove_bytes: int = 1 << 16):
        """`clock`: monotonic() and time() (the `time` module; None: a ManualClock at 0, for tests)."""
        if trees < 1 or fanout < 1:
            raise ValueError("trees and fanout must be >= 1")
        self.origin_url, self.trees, self.fanout = origin_url, trees, fanout
        self.heartbeat_s = heartbeat_s
        self.dead_after = 3 * heartbeat_s + 1.0
        self.clock = clock or ManualClock()
        self.max_peers, self.penalty_limit = max_peers, penalty_limit
        self.peers: dict[str, PeerRec] = {}
        self._by_url: dict[str, PeerRec] = {}  # members by their relay address (every heartbeat looks up 64)
        self.standing = Standing(self.clock, penalty_limit, prove_bytes)
        self.bans = Bans(self.clock)
        self.refused: collections.Counter[str] = collections.Counter()
        self.events: collections.deque[str] = collections.deque(maxlen=200)
        self._seq = 0
        self.latest: int | None = None  # the newest version, as the origin last said
        self._layout: Layout | None = None  # this version's trees (broadcast/layout.py); None: lay out afresh
        self.uploads = UploadMeter()  # placement: children's reports of what each source uploaded

    # -- what standing.py decides, and what the layout does about it ---------------------------------------
    trusted = property(lambda self: self.standing.trusted)
    proven = property(lambda self: self.standing.proven)
    banned = property(lambda self: self.bans.by_peer)
    banned_keys = property(lambda self: self.bans.keys)
    banned_urls = property(lambda self: self.bans.urls)

    def event(self, msg: str) -> None:
        self.events.append(f"{datetime.datetime.fromtimestamp(self.clock.time()):%H:%M:%S} {msg}")

    def count(self, reason: str, msg: str | None = None) -> None:
        self.refused[reason] += 1
        if msg:
            self.event(msg)

    def points(self, key: str) -> float:
        return self.standing.points(key)

    def penalize(self, key: str, why: str) -> None:
        """An unconfirmed report: it costs the reporter, never the accused."""
        self.standing.penalize(key)
        self.count("unconfirmed_report", f"unconfirmed report by {key[:12]}: {why}")

    def has_standing(self, rec: PeerRec) -> bool:
        return self.standing.has(rec.key)

    def set_trusted(self, key: str, trusted: bool = True) -> None:
        if not self.standing.trust(key, trusted):
            return
        if trusted:
            self._relayout()
        elif any(p.key == key for p in self.peers.values()):
            self._layout = None  # it may sit above peers with standing: not even for the rest of a version

    def prove(self, rec: PeerRec, how: str) -> None:
        if self.standing.prove(rec.key):
            self._relayout()
            self.event(f"{rec.peer_id} {rec.name} has shown it uploads ({how})")

    def _ranked(self, rec: PeerRec) -> bool:
        return self.standing.ranked(rec.key)

    def _ranked_id(self, peer_id: str | None) -> bool:
        rec = self.peers.get(peer_id) if peer_id is not None else None
        return rec is not None and self._ranked(rec)

    # -- the layout: afresh when nothing is in flight, repaired in place while a version is ---------------
    def in_flight(self) -> bool:
        return self.latest is not None and any(self.latest not in p.complete for p in self.peers.values())

    def _relayout(self) -> None:
        """Something the layout depends on changed: lay out afresh, unless that would move peers mid-version."""
        if not self.in_flight():
            self._layout = None

    def _repair(self, how: str, peer_id: str) -> None:
        if self._layout is None or not self.in_flight():
            self._layout = None
        else:
            getattr(self._layout, how)(peer_id, self._ranked_id)

    # -- membership -----------------------------------------------------------------------------------
    def check_admission(self, key: str, url: str | None) -> None:
        """Refusals that need no network: a banned key or address, a full tracker."""
        if (refused := self.bans.refusal(key, url)) is not None:
            raise refused
        if len(self.peers) >= self.max_peers and not any(p.key == key for p in self.peers.values()):
            self.reap()
            if len(self.peers) >= self.max_peers:
                raise TrackerError(503, f"the tracker holds its maximum of {self.max_peers} peers", "full")

    def url_holder(self, url: str, key: str) -> PeerRec | None:
        """The live member of another key holding `url`, if any."""
        p = self._by_url.get(url)
        return p if p is not None and p.key != key else None

    def join(self, msg: Join, *, key: str | None = None, url: str | None = None, reachable: bool | None = True,
             reach_error: str = "", observed_host: str = "") -> Joined:
        """Admit a member. `key` is its verified identity (None: an in-process caller, given a throwaway
        one); `url` its checked address (default msg.url); `reachable` what the connect-back found."""
        url = msg.url if url is None else url
        key = key or "anon-" + secrets.token_hex(8)
        self.check_admission(key, url)
        if url is not None and (holder := self.url_holder(url, key)) is not None:
            raise TrackerError(409, f"{url} is held by another live peer ({holder.peer_id})", "url_taken")
        for p in [p for p in self.peers.values() if p.key == key]:
            self.remove(p.peer_id, "rejoined")  # one live membership per key: a restart replaces it
        self._seq += 1
        relay = msg.relay and url is not None
        rec = PeerRec(secrets.token_hex(8), secrets.token_hex(16), msg.name[:64], url, relay, self._seq, key,
                      reachable=reachable if relay else None, reach_error=reach_error[:200],
                      last_hb=self.clock.monotonic())
        if rec.interior_capable:
            rec.group = self._smallest_group()
        self.peers[rec.peer_id] = rec
        if rec.url is not None:
            self._by_url[rec.url] = rec
        self._repair("add", rec.peer_id)
        self.event(f"join {rec.peer_id} {rec.name} {rec.url or '(no relay)'} key={key[:12]} group={rec.group}"
                   + ("" if rec.reachable is not False else " (not reachable: leaf)"))
        return Joined(rec.peer_id, rec.token, self.trees, self.heartbeat_s, rec.url, observed_host,
                      rec.reachable, rec.reach_error)

    def set_reachable(self, rec: PeerRec, reachable: bool, error: str = "") -> None:
        if rec.reachable == reachable:
            return
        rec.reachable, rec.reach_error = reachable, error[:200]
        if reachable and rec.interior_capable and rec.group is None:
            rec.group = self._smallest_group()
            self._relayout()
        elif not reachable:
            if rec.group is not None:
                rec.group = None
                self._rebalance()
            self._repair("make_leaf", rec.peer_id)
        self.event(f"{rec.peer_id} {rec.name} {'reachable again' if reachable else 'not reachable: leaf'}"
                   + (f" ({error})" if error else ""))

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
        rec.last_hb = self.clock.monotonic()
        rec.complete = sorted(msg.complete)[-64:]
        rec.progress = dict(list(msg.progress.items())[:64])
        rec.served_bytes = max(0, msg.served_bytes)
        if self.has_standing(rec):
            # What it received from each parent: evidence that parent uploads, if the parent says so too.
            for url, n in list(msg.received.items())[:64]:
                src = self.by_url(url)
                if src is not None and src is not rec and n > 0 and self.standing.confirm(src, rec.key, n):
                    self.prove(src, f"{src.uploaded} bytes confirmed by its children")
        # Placement by measured uplinks: a fresh key's numbers could be made up, so only standing counts.
        self._note_uploads(rec, msg.recent if self.has_standing(rec) else {}, latest)
        return TreeSources(latest, self.sources(rec.peer_id), rec.reachable)

    def remove(self, peer_id: str, why: str) -> None:
        rec = self.peers.pop(peer_id, None)
        if rec is None:
            return
        if rec.url is not None and self._by_url.get(rec.url) is rec:
            del self._by_url[rec.url]
        self._repair("remove", peer_id)
        if rec.group is not None:
            self._rebalance()
        self.event(f"remove {peer_id} {rec.name} ({why})")

    def ban(self, peer_id: str, reason: str, reporter: str) -> None:
        rec = self.peers.get(peer_id)
        url, key = (rec.url, rec.key) if rec else (None, "")
        self.bans.member(peer_id, url, key, reason, reporter)
        self.remove(peer_id, f"banned: {reason}")

    def ban_key(self, key: str, reason: str, by: str = "trainer") -> None:
        """Ban an identity, member or not (the trainer's bans are the tree's too)."""
        members = [p.peer_id for p in self.peers.values() if p.key == key]
        for pid in members:
            self.ban(pid, reason, by)
        if not members:
            self.bans.key(key, reason, by)
        self.event(f"key {key[:12]} banned by {by}: {reason}")

    def demote(self, peer_id: str, why: str) -> None:
        rec = self.peers.get(peer_id)
        if rec and not rec.demoted:
            rec.demoted = True
            rec.group = None
            self.standing.revoke(rec.key)
            self._repair("make_leaf", peer_id)
            self._rebalance()
            self.event(f"demote {peer_id} to leaf ({why})")

    def reap(self) -> list[str]:
        now = self.clock.monotonic()
        dead = [p.peer_id for p in self.peers.values() if now - p.last_hb > self.dead_after]
        for pid in dead:
            self.remove(pid, "heartbeat timeout")
        return dead

    def reach_rechecks(self, every: float = 30.0, at_once: int = 2) -> list[PeerRec]:
        """Relays found unreachable, due to be connected back to again (at most `at_once`, each `every` s)."""
        now, due = self.clock.monotonic(), []
        for rec in self.peers.values():
            if rec.relay and rec.reachable is False and now - rec.rechecked > every and len(due) < at_once:
                rec.rechecked = now
                due.append(rec)
        return due

    def by_url(self, url: str) -> PeerRec | None:
        return self._by_url.get(url)

    # -- topology -------------------------------------------------------------------------------------
    def topology(self) -> tuple[list[dict[str, str | None]], list[dict[str | None, list[str]]]]:
        """Per tree: parent of each peer (None = origin) and children of each node (None key = origin)."""
        if self._layout is None:
            ordered = sorted(self.peers.values(), key=lambda p: p.seq)
            if self.uploads.placed or self.uploads.probed:
                self._layout = self._measured_layout(ordered)
            else:
                self._layout = join_order_layout(
                    [(p.peer_id, p.group if p.interior_capable else None, self._ranked(p)) for p in ordered],
                    self.trees, self.fanout)
        return self._layout.topology()

    # -- placement by measured uplink (broadcast/placement.py) -----------------------------------------------
    def _note_uploads(self, rec: PeerRec, received: dict[str, Received], latest: int | None) -> None:
        if latest is not None and latest != self.latest:
            self.latest = latest
            self._layout = None  # a new version: a fresh layout, repaired in place until it is everywhere
        if latest is not None and latest != self.uploads.epoch:
            live = {p.url for p in self.peers.values() if p.url} | {ORIGIN}
            if self.uploads.new_epoch(latest, live):
                for p in self.peers.values():
                    # A stall report blames the relay a child waited on, often the victim of a slow one above
                    # it; once uplinks are measured, the new layout decides again (a real staller re-earns it).
                    if p.demoted and p.url in self.uploads.placed:
                        p.demoted = False
                        p.reporters.clear()
        if received:
            self.uploads.note(received, rec.key)

    def probed(self, rec: PeerRec, rate: float) -> None:
        """The origin timed a download from this relay (broadcast/uplink_probe.py): the next layout uses it."""
        self.uploads.note_probe(rec.url or "", rate)
        self._relayout()

    def _measured_layout(self, ordered: list[PeerRec]) -> Layout:
        """Peers with standing (or a measured uplink) are laid out by uplink; fresh keys are leaves in the
        spare places: they may not size the trees (24 fresh relays that never downloaded made the honest
        relays' tree nearly a star, and their versions 2.8x slower)."""
        up = self.uploads
        sized = {p.peer_id for p in ordered if self._ranked(p) or p.url in up.placed}
        keep, fresh = [p for p in ordered if p.peer_id in sized], [p for p in ordered if p.peer_id not in sized]
        cands = [Candidate(p.peer_id, p.url, p.interior_capable, p.group, up.uplink(p.url) if p.url else None)
                 for p in keep]
        group, parents, children, caps = measured_layout(cands, self.trees, self.fanout,
                                                         up.placed.get(ORIGIN), len(fresh))
        for p in keep:
            p.group = group[p.peer_id]
        layout = Layout(parents, children, caps)
        for p in fresh:
            layout.add(p.peer_id, self._ranked_id)
        return layout

    def sources(self, peer_id: str) -> list[list[str]]:
        """For each tree, the chain of ancestor URLs, parent first; the origin above them is left out: each
        peer reaches it at its own tracker URL (the origin's bind address may be 0.0.0.0)."""
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
            out.append(chain)
        return out

    def view(self, latest: int | None, versions: list[int]) -> TreeView:
        parents, children = self.topology()
        now = self.clock.monotonic()
        peers = [
            PeerView(
                p.peer_id, p.name, p.url, p.relay, p.group, p.complete, p.progress, round(now - p.last_hb, 2),
                p.strikes, [parents[t].get(p.peer_id) for t in range(self.trees)],
                [children[t].get(p.peer_id, []) for t in range(self.trees)],
                key=p.key, reachable=p.reachable, reach_error=p.reach_error, standing=self.has_standing(p),
                proven=p.key in self.proven, uploaded=p.uploaded, demoted=p.demoted,
                uplink=self.uploads.uplink(p.url or ""),
                uplink_probed=(p.url or "") not in self.uploads.placed and (p.url or "") in self.uploads.probed)
            for p in sorted(self.peers.values(), key=lambda p: p.seq)
        ]
        return TreeView(self.origin_url, self.trees, self.fanout, latest, versions,
                        [children[t].get(None, []) for t in range(self.trees)], peers,
                        list(self.banned_keys.values())[-100:], list(self.events), dict(self.refused))

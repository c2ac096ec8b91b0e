"""A peer in simulated time, driving the real peer's decisions: broadcast/sourcing.SourceBook and
broadcast/piece_race.PieceRace choose sources, deadlines, bypasses, reports, failover and retries, as they
do in broadcast/fetcher.py; broadcast/turns.TurnQueue orders what it serves. This file only models the I/O:

- a request reaches its source one path latency after it is sent; a source that is gone refuses it (the
  answer: 'unreachable', a dead report); a live one answers at once (the answer back one latency later),
  then holds it until the piece is here (pipelining), at most PeerConfig.hold_s, then cuts the answer
  short ('cut'), as serving.py does;
- a source that goes away cuts every request it had answered ('cut'), as a closed connection does;
- bytes flow as engine.py's transfers; the race looks at them whenever it looks (a stream in progress is a
  source heard from just now); hashing costs no time.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from broadcast.messages import PeerHeartbeat, Report, TreeSources
from broadcast.piece_race import PieceRace
from broadcast.piece_race import Report as RaceReport
from broadcast.sourcing import SourceBook, Try
from broadcast.turns import TurnQueue, turn_key
from broadcast.uplink_share import LOW_SHARE

from .engine import Host, Xfer

if TYPE_CHECKING:
    from .world import World


class Req:
    """One try in flight: where it is, and what it holds."""

    __slots__ = ("peer", "rs", "tr", "index", "src", "state", "xfer", "sent_from", "key")

    def __init__(self, peer: SimPeer, rs: RaceState, tr: Try, index: int, src: SimPeer | None):
        self.peer, self.rs, self.tr, self.index, self.src = peer, rs, tr, index, src  # src None: the origin
        self.state = "asked"  # asked | held | queued | sending | over
        self.xfer: Xfer | None = None
        self.sent_from = 0.0
        self.key = turn_key(peer.url, index, peer.sw.trees)


class RaceState:
    __slots__ = ("race", "tree", "index", "failures", "reqs", "look_gen", "version")

    def __init__(self, race: PieceRace, tree: int, index: int, failures: int, version: int):
        self.race, self.tree, self.index, self.failures, self.version = race, tree, index, failures, version
        self.reqs: dict[Try, Req] = {}
        self.look_gen = 0


class SimPeer:
    def __init__(self, idx: int, host: Host, sw: World):
        self.idx, self.host, self.sw = idx, host, sw
        self.url = f"http://p{idx}:1"
        self.book = SourceBook(sw.peer_cfg)
        self.book.trees = sw.trees
        self.pid = self.token = ""
        self.sources: list[list[str]] = []
        self.low: frozenset[str] = frozenset()  # hosts below us sent to after the others (uplink_share.py)
        host.low_share = LOW_SHARE
        self.version = 0
        self.have = bytearray()
        self.n_have = 0
        self.held: dict[int, list[Req]] = collections.defaultdict(list)  # children's requests waiting here
        # Dicts, not sets: iterated in insertion order, not by memory address (runs repeat).
        self.serving: dict[Req, None] = {}  # requests this peer answered and has not finished (cut if it goes)
        self.sending: dict[Req, None] = {}  # our requests whose bytes are arriving now
        self.turns = TurnQueue()  # our children's requests take turns
        self.queues: list[collections.deque] = []
        self.complete: list[int] = []
        self.done_at: dict[int, float] = {}
        self.manifest_waiters: list = []  # children waiting for our manifest of the version in flight
        self.hb_gen = 0
        self.served_bytes = 0
        self.relay = True  # False: nobody can reach it (behind a NAT): it joins as a download-only leaf

    def holds(self, version: int, index: int) -> bool:
        return self.version == version and 0 <= index < len(self.have) and bool(self.have[index])

    def relays(self, tree: int) -> list[str]:
        return self.sources[tree % len(self.sources)] if self.sources else []

    # -- membership (tracker_client.py's rules) ----------------------------------------------------------
    def heartbeat(self, periodic: bool = False) -> None:
        sw = self.sw
        if not self.host.alive or not self.pid:
            return
        if periodic:
            self.hb_gen += 1
            sw.sim.after(sw.origin_cfg.heartbeat_s, self._tick, self.hb_gen)
        progress = {self.version: self.n_have} if self.version and self.version not in self.done_at else {}
        msg = PeerHeartbeat(self.pid, self.token, list(self.complete), progress, self.served_bytes,
                            dict(list(self.book.received.items())[-64:]),
                            self.book.meter.take() if sw.report_uploads else {})
        sw.sim.after(sw.to_origin(self), self._hb_at_origin, msg)

    def _tick(self, gen: int) -> None:
        if gen == self.hb_gen:
            self.heartbeat(periodic=True)

    def _hb_at_origin(self, msg: PeerHeartbeat) -> None:
        if not self.host.alive:
            return
        ans = self.sw.origin.heartbeat(msg, self.sw.latest or None)
        if ans is None:  # the tracker forgot us (reaped): join again
            self.sw.sim.after(self.sw.to_origin(self), self.sw.join, self)
            return
        self.sw.sim.after(self.sw.to_origin(self), self._set_sources, ans)

    def _set_sources(self, ans: TreeSources) -> None:
        """As tracker_client.py takes a heartbeat's answer."""
        self.sources, self.low, self.book.on_trial = ans.sources, frozenset(ans.low), frozenset(ans.trial)

    def report(self, r: RaceReport, version: int, piece: int, answered=None) -> None:
        """To the origin; `answered()` once its answer is back; a heartbeat then (new parents)."""
        sw = self.sw
        sw.reports[r.reason] += 1
        back = sw.to_origin(self)
        msg = Report(self.pid, self.token, r.src, r.reason, version, piece, r.detail)  # type: ignore[arg-type]

        def at_origin() -> None:
            sw.origin.report(self.pid, msg, lambda _: sw.sim.after(back, after))

        def after() -> None:
            self.heartbeat()
            if answered:
                answered()

        sw.sim.after(back, at_origin)

    # -- a version (downloads.py's rules) -----------------------------------------------------------------
    def begin(self, v: int) -> None:
        """The long poll said v is out: a heartbeat for fresh parents, the manifest from the nearest
        ancestor that holds it, then trees x window workers."""
        if not self.host.alive or self.version >= v:
            return
        self.version = v
        self.have = bytearray(self.sw.n_pieces(v))
        self.n_have = 0
        self.sw.pending += 1
        self.heartbeat()
        self.sw.sim.after(2 * self.sw.to_origin(self), self._ask_manifest, v, 0)

    def _ask_manifest(self, v: int, pos: int) -> None:
        sw = self.sw
        if not self.host.alive or self.version != v:
            return
        chain = self.book.chain(self.relays(v % sw.trees), sw.sim.now)
        src = sw.peers.get(chain[pos]) if pos < len(chain) - 1 else None
        if src is None:  # the origin
            sw.sim.after(2 * sw.to_origin(self), self._manifest_in, v)
            return
        there = sw.lat(self, src)
        if not src.host.alive:  # refused: the next one up
            sw.sim.after(2 * there, self._ask_manifest, v, pos + 1)
        elif src.version == v:
            sw.sim.after(2 * there, self._manifest_in, v)
        else:  # it holds our request until it has the manifest itself; we wait as downloads.py's timeout says
            wait = [self, v, there, pos]
            src.manifest_waiters.append(wait)
            sw.sim.after(there + 2 * sw.peer_cfg.first_byte_timeout, self._manifest_late, src, wait)

    def _manifest_late(self, src: SimPeer, wait: list) -> None:
        if wait in src.manifest_waiters:  # no answer in time (or it went away): the next one up
            src.manifest_waiters.remove(wait)
            self._ask_manifest(wait[1], wait[3] + 1)

    def _manifest_in(self, v: int) -> None:
        sw = self.sw
        if not self.host.alive or self.version != v:
            return
        for child, cv, there, _ in self.manifest_waiters:
            if cv == v:
                sw.sim.after(there, child._manifest_in, v)
        self.manifest_waiters.clear()
        n = len(self.have)
        self.queues = [collections.deque(i for i in range(t, n, sw.trees) if not self.have[i])
                       for t in range(sw.trees)]
        for t in range(sw.trees):
            for _ in range(sw.peer_cfg.window):
                self.next_piece(t)

    def next_piece(self, t: int) -> None:
        if not self.host.alive:
            return
        q = self.queues[t]
        while q and self.have[q[0]]:
            q.popleft()
        if q:
            self.sw.fetch.race(self, t, q.popleft(), 0)

    def got_piece(self, i: int) -> None:
        sw = self.sw
        if self.have[i]:
            return
        self.have[i] = 1
        self.n_have += 1
        for req in self.held.pop(i, ()):
            if req.state == "held":
                sw.fetch.serve(req)
        if self.n_have == len(self.have):
            self.done_at[self.version] = sw.sim.now
            self.complete = sorted([*self.complete, self.version])[-sw.peer_cfg.keep:]
            sw.pending -= 1
            self.heartbeat()
            if sw.pending == 0 and sw.on_all_done:
                sw.on_all_done()

    def depart(self) -> None:
        """Gone (left or died): what it served is cut short, what it asked for is dropped."""
        sw = self.sw
        self.host.alive = False
        if self.version == sw.latest and sw.latest not in self.done_at:
            sw.pending -= 1
        for req in list(self.serving):
            sw.fetch.cut(req)
        for wait in list(self.manifest_waiters):  # their manifest requests are cut short: the next one up
            sw.sim.after(wait[2], wait[0]._manifest_late, self, wait)
        self.held.clear()
        for x in list(self.host.outs) + list(self.host.ins):
            sw.net.cancel(x)

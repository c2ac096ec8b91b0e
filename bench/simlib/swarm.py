"""Peers that behave as broadcast/peer.py does, against the real broadcast.tracker.Tracker in simulated time.

The tracker is driven exactly as broadcast/origin.py drives it: join on /join, heartbeat on /heartbeat (its
answer is the peer's sources), remove on /leave, reap every heartbeat interval, and reports judged as
origin._judge does (a health probe of the accused; dead -> remove, two stall reporters -> demote). A peer
fetches piece i down tree i mod k with `window` requests in flight per tree, tries its chain parent first,
origin last, skipping blacklisted sources; a source that refuses or resets is reported and blacklisted for
30 s, and once the report is answered the piece is asked of the parents the next heartbeat brings (no sooner
than the usual backoff; `fresh_after_dead=False`: of the next ancestor, as peer.py did before 2026-12-05);
a held request unanswered for piece_wait gets a 503 (a stall report), and the next ancestor is asked once the
report is answered. A source sends a child's requests on one tree one at a time (serving.Turns;
`turns=False`: all at once). Hashing costs no time here.
"""

from __future__ import annotations

import collections
import contextlib
import time as _time

import broadcast.tracker as tracker_mod
from broadcast.messages import ORIGIN, Join, PeerHeartbeat
from broadcast.receive_meter import ReceiveMeter
from broadcast.tracker import Tracker, TrackerError

from .engine import Host, Net, Sim, Xfer
from .probes import SimProber

TEMP_BLACKLIST_S = 30.0  # as broadcast/peer.py
MAX_FAILURES_PER_PIECE = 20


def _backoff(failures: int) -> float:
    """peer.py's wait before asking again after `failures` failed races (sourcing._fetch_piece)."""
    return min(0.1 * failures, 2.0)


class _SimClock:
    """Stands in for the `time` module inside broadcast.tracker, so liveness runs on simulated seconds."""

    def __init__(self, sim: Sim):
        self.sim = sim

    def monotonic(self) -> float:
        return self.sim.now

    def time(self) -> float:
        return self.sim.now

    strftime = staticmethod(_time.strftime)


@contextlib.contextmanager
def simulated_time(sim: Sim):
    real = tracker_mod.time
    tracker_mod.time = _SimClock(sim)  # type: ignore[assignment]
    try:
        yield
    finally:
        tracker_mod.time = real


class SimPeer:
    def __init__(self, idx: int, host: Host):
        self.idx = idx
        self.host = host
        self.url = f"http://p{idx}:1"
        self.pid = ""
        self.token = ""
        self.sources: list[list[str]] = []
        self.blacklist: dict[str, float] = {}
        self.version = 0
        self.have = bytearray()
        self.n_have = 0
        self.held: dict[int, list] = collections.defaultdict(list)
        self.queues: list[collections.deque] = []
        self.complete: list[int] = []
        self.done_at: dict[int, float] = {}
        self.hb_gen = 0
        self.xfers: set[Xfer] = set()
        self.meter: ReceiveMeter | None = None  # broadcast/peer.py's own meter, on simulated time


class Swarm:
    def __init__(self, sim: Sim, origin: Host, trees: int, fanout: int, piece: int, window: int = 2,
                 heartbeat: float = 2.0, stall_timeout: float = 30.0, report_uploads: bool = True,
                 turns: bool = True, fresh_after_dead: bool = True, probes: bool = True):
        self.sim, self.net = sim, Net(sim)
        self.origin = origin
        self.origin_url = ORIGIN  # each real peer reaches it at its tracker URL
        self.tracker = Tracker(self.origin_url, trees, fanout, heartbeat, max_peers=1 << 20)  # churn: N + arrivals
        self.trees, self.piece, self.window = trees, piece, window
        self.hb = heartbeat
        self.piece_wait = 0.6 * stall_timeout  # broadcast/peer.py serves with stall_timeout * 0.6
        self.report_uploads = report_uploads
        self.one_at_a_time = turns  # serving.py's Turns; False: a child's requests share its share
        self.fresh_after_dead = fresh_after_dead  # False: a dead parent's piece goes to the next ancestor
        self.prober = SimProber(self) if probes else None  # None: no uplink probes, as before 2026-12-05
        self.turns: dict[tuple[str, int, int], collections.deque] = {}  # (source, child, tree) -> queue
        self.peers: dict[str, SimPeer] = {}  # by url
        self.latest = 0
        self.sizes: dict[int, int] = {}
        self.pending = 0  # live peers that still lack the latest version
        self.reports = collections.Counter()
        self.sim.after(heartbeat, self._reap)

    # -- helpers ----------------------------------------------------------------------------------------
    def _lat(self, a: Host, b: Host) -> float:
        return a.lat + b.lat

    def host_of(self, url: str) -> Host | None:
        if url == self.origin_url:
            return self.origin
        p = self.peers.get(url)
        return p.host if p else None

    def _n_pieces(self, v: int) -> int:
        return -(-self.sizes[v] // self.piece)

    def _piece_size(self, v: int, i: int) -> int:
        return min(self.piece, self.sizes[v] - i * self.piece)

    # -- membership -------------------------------------------------------------------------------------
    def arrive(self, p: SimPeer) -> None:
        self.peers[p.url] = p
        p.meter = ReceiveMeter()
        self.sim.after(p.host.lat + self.origin.lat, self._join, p)

    def _join(self, p: SimPeer) -> None:
        if not p.host.alive:
            return
        # The simulated peers are honest keys with standing (as an established node, or a relay that has
        # shown it uploads): only such peers' reports of what they received count for placement.
        key = f"sim-{p.idx}"
        self.tracker.set_trusted(key)
        j = self.tracker.join(Join(p.url, True, f"p{p.idx}"), key=key)
        p.pid, p.token = j.peer_id, j.token
        self.sim.after(p.host.lat + self.origin.lat, self._joined, p)

    def _joined(self, p: SimPeer) -> None:
        self._heartbeat(p, periodic=True)
        if self.latest and self.latest not in p.done_at:
            self.sim.after(2 * self._lat(p.host, self.origin), self._begin, p, self.latest)

    def depart(self, p: SimPeer, graceful: bool) -> None:
        """graceful: Peer.stop() posts /leave; otherwise the process dies (connections reset, no leave)."""
        if not p.host.alive:
            return
        p.host.alive = False
        if p.version == self.latest and self.latest not in p.done_at:
            self.pending -= 1
        for x in list(p.host.outs) + list(p.host.ins):
            self.net.cancel(x)
        for reqs in p.held.values():
            for req in reqs:
                req[6] = False
                self.sim.after(self._lat(req[0].host, p.host), self._failed, req, "dead")
        p.held.clear()
        if graceful and p.pid:
            self.sim.after(p.host.lat + self.origin.lat, self.tracker.remove, p.pid, "left")

    def _reap(self) -> None:
        self.tracker.reap()
        self.sim.after(self.hb, self._reap)

    # -- heartbeats -------------------------------------------------------------------------------------
    def _heartbeat(self, p: SimPeer, periodic: bool = False) -> None:
        if not p.host.alive:
            return
        if periodic:
            p.hb_gen += 1
            self.sim.after(self.hb, self._tick, p, p.hb_gen)
        received = {"recent": p.meter.take()} if self.report_uploads else {}
        progress = {p.version: p.n_have} if p.version and p.version not in p.done_at else {}
        msg = PeerHeartbeat(p.pid, p.token, list(p.complete), progress, **received)
        self.sim.after(p.host.lat + self.origin.lat, self._hb_at_tracker, p, msg)

    def _tick(self, p: SimPeer, gen: int) -> None:
        if gen == p.hb_gen:
            self._heartbeat(p, periodic=True)

    def _hb_at_tracker(self, p: SimPeer, msg: PeerHeartbeat) -> None:
        if not p.host.alive:
            return
        try:
            ans = self.tracker.heartbeat(msg, self.latest or None)
        except TrackerError as e:
            if e.status == 404:  # the tracker forgot us (reaped): join again, as peer.py does
                self.sim.after(p.host.lat + self.origin.lat, self._join, p)
            return
        self.sim.after(p.host.lat + self.origin.lat, self._set_sources, p, ans.sources)
        if self.prober:
            self.prober.after_heartbeat(p)

    def _set_sources(self, p: SimPeer, sources: list[list[str]]) -> None:
        p.sources = sources

    # -- a version ---------------------------------------------------------------------------------------
    def publish(self, v: int, size: int) -> None:
        self.latest = v
        self.sizes[v] = size
        for p in self.peers.values():
            if p.host.alive and p.pid:  # the long poll answers at once
                self.sim.after(2 * self._lat(p.host, self.origin), self._begin, p, v)

    def _begin(self, p: SimPeer, v: int) -> None:
        """Manifest from the origin, one heartbeat for fresh parents, then k x window workers."""
        if not p.host.alive or p.version >= v:
            return
        p.version = v
        n = self._n_pieces(v)
        p.have = bytearray(n)
        p.n_have = 0  # requests children made before we began stay held (peer.py's _lookup waits too)
        self.pending += 1
        rtt = 2 * self._lat(p.host, self.origin)
        self._heartbeat(p)
        p.queues = [collections.deque(range(t, n, self.trees)) for t in range(self.trees)]
        for t in range(self.trees):
            for _ in range(self.window):
                self.sim.after(2 * rtt, self._next, p, t)

    def _next(self, p: SimPeer, t: int) -> None:
        if not p.host.alive:
            return
        q = p.queues[t]
        while q and p.have[q[0]]:
            q.popleft()
        if q:
            self._try(p, t, q.popleft(), 0)

    def _chain(self, p: SimPeer, t: int) -> list[str]:
        now = self.sim.now
        src = p.sources[t % len(p.sources)] if p.sources else []
        chain = [u for u in src if p.blacklist.get(u, 0) < now]
        if not chain or chain[-1] != self.origin_url:
            chain.append(self.origin_url)
        return chain

    def _try(self, p: SimPeer, t: int, i: int, failures: int, chain: list[str] | None = None, pos: int = 0):
        if not p.host.alive or p.version != self.latest:
            return
        if chain is None:
            chain = self._chain(p, t)
        url = chain[pos]
        src = self.host_of(url)
        # req: peer, tree, piece, failures, chain, pos, still-waiting, source url
        req = [p, t, i, failures, chain, pos, True, url, 0.0]  # [8]: when the source began sending
        lat = self._lat(p.host, src) if src else p.host.lat
        self.sim.after(lat, self._at_source, req, src)

    def _at_source(self, req: list, src: Host | None) -> None:
        p, i, url = req[0], req[2], req[7]
        if not p.host.alive:
            return
        if src is None or not src.alive:  # connection refused / reset: known one round trip later
            self.sim.after(self._lat(p.host, src) if src else p.host.lat, self._failed, req, "dead")
            return
        if src is self.origin:
            self._send(req, src)
            return
        sp = self.peers[url]
        if sp.version == p.version and sp.have[i]:
            self._send(req, src)
            return
        sp.held[i].append(req)  # pipelining: held until the source has verified it
        self.sim.after(self.piece_wait, self._held_timeout, req, sp)

    def _held_timeout(self, req: list, sp: SimPeer) -> None:
        if req[6] and req in sp.held.get(req[2], ()):
            sp.held[req[2]].remove(req)
            req[6] = False
            self.sim.after(self._lat(req[0].host, sp.host), self._failed, req, "stall")

    def _send(self, req: list, src: Host) -> None:
        p = req[0]
        req[6] = False
        if not p.host.alive:
            return
        if self.one_at_a_time:  # broadcast/serving.py: a child's requests to one source take turns
            turn = self.turns.setdefault((src.name, p.idx, req[1]), collections.deque())
            turn.append((req, src))
            if len(turn) > 1:
                return
        self._start(req, src)

    def _start(self, req: list, src: Host) -> None:
        p = req[0]
        req[8] = self.sim.now
        size = self._piece_size(p.version, req[2])
        self.net.start(src, p.host, size, lambda x, ok, r=req, s=src: self._sent(r, ok, s))

    def _sent(self, req: list, ok: bool, src_host: Host) -> None:
        p = req[0]
        if self.one_at_a_time:
            turn = self.turns.get((src_host.name, p.idx, req[1]))
            if turn:
                turn.popleft()
                if not src_host.alive:  # the source died: the requests waiting their turn are reset too
                    for r, _ in turn:
                        self.sim.after(self._lat(p.host, src_host), self._failed, r, "dead")
                    turn.clear()
                elif not p.host.alive:  # the child died: nothing more to send it
                    turn.clear()
                if turn:
                    self._start(*turn[0])
                else:
                    del self.turns[(src_host.name, p.idx, req[1])]
        p.meter.span(req[7], req[8], self.sim.now)
        if ok:
            p.meter.credit(req[7], self._piece_size(p.version, req[2]))
        src = self.host_of(req[7])
        lat = self._lat(p.host, src) if src else p.host.lat
        self.sim.after(lat, self._arrived if ok else self._failed, req, *(() if ok else ("dead",)))

    def _arrived(self, req: list) -> None:
        p, t, i = req[0], req[1], req[2]
        if not p.host.alive or p.version != self.latest:
            return
        if not p.have[i]:
            p.have[i] = 1
            p.n_have += 1
            for r in p.held.pop(i, ()):
                if r[6]:
                    self._send(r, p.host)
            if p.n_have == len(p.have):
                p.done_at[p.version] = self.sim.now
                p.complete = sorted([*p.complete, p.version])[-3:]
                self.pending -= 1
                self._heartbeat(p)
                if self.pending == 0 and self.on_all_done:
                    self.on_all_done()
        self._next(p, t)

    on_all_done = None

    def _failed(self, req: list, reason: str) -> None:
        p, t, i, failures, chain, pos, _, url, _ = req
        if not p.host.alive or p.version != self.latest:
            return
        if url != self.origin_url:
            p.blacklist[url] = self.sim.now + TEMP_BLACKLIST_S
            self.reports[reason] += 1
            # The worker awaits the report: to the origin, its health probe of the accused, and back.
            accused = self.host_of(url)
            probe = 2 * self._lat(self.origin, accused) if accused else 0.0
            to_origin = self._lat(p.host, self.origin)
            self.sim.after(to_origin + probe, self._judge, p.pid, url, reason)
            self.sim.after(2 * to_origin + probe, self._after_report, req, reason)
        else:
            self.sim.after(_backoff(failures + 1), self._try, p, t, i, failures + 1)

    def _after_report(self, req: list, reason: str) -> None:
        """sourcing.py once its report is answered: a dead source's piece is asked anew of the parents the
        next heartbeat brings; after any other failure, of the next ancestor in the chain at once."""
        p, t, i, failures, chain, pos = req[0], req[1], req[2], req[3] + 1, req[4], req[5]
        self._heartbeat(p)  # peer.py sets _hb_now after a report
        if failures >= MAX_FAILURES_PER_PIECE:
            raise RuntimeError(f"p{p.idx}: piece {i} failed {failures} times (peer.py would give up)")
        if reason == "dead" and self.fresh_after_dead:
            # peer.py waits for the heartbeat that answers its report, and at least its usual backoff
            wait = max(2 * self._lat(p.host, self.origin), _backoff(failures))
            self.sim.after(wait, self._try, p, t, i, failures)
        elif pos + 1 < len(chain):
            self._try(p, t, i, failures, chain, pos + 1)
        else:
            self.sim.after(_backoff(failures), self._try, p, t, i, failures)

    def _judge(self, reporter: str, url: str, reason: str) -> None:
        """origin._judge for dead/stall reports (corrupt data is not simulated)."""
        t = self.tracker
        rec = t.by_url(url)
        if rec is None:
            return
        host = self.host_of(url)
        if host is None or not host.alive:
            t.remove(rec.peer_id, f"{reason} reported by {reporter}, health probe failed")
            return
        rec.reporters.add(reporter)
        rec.strikes += 1
        if reason == "stall" and len(rec.reporters) >= 2:
            t.demote(rec.peer_id, f"stalls reported by {sorted(rec.reporters)}")

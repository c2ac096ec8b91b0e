"""The origin in simulated time: the real tracker (broadcast/tracker.py) on the simulation's clock, the real
verdicts (broadcast/verdicts.py) on simulated probes, and the real uplink plan (broadcast/uplink_plan.py)
with each probe's 1 MiB as a transfer from the relay to the origin that shares both their links.

As broadcast/origin.py and origin_routes.py drive them: a join (the connect-back reaches every simulated
relay), a heartbeat (its answer is the peer's sources; then the proof that it uploads, and the uplink plan),
a leave, a reap every heartbeat interval, and reports through the same gate to the same verdicts. Not
modelled: signatures, join rate limits, the probe cache (one probe answers reports for 2 s), corruption.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from broadcast.config import OriginConfig
from broadcast.messages import ORIGIN, Join, PeerHeartbeat, Report, TreeSources
from broadcast.tracker import PeerRec, Tracker, TrackerError
from broadcast.turns import TurnQueue
from broadcast.uplink_plan import PROBE_BYTES, PROBE_MAX_S, UplinkPlan
from broadcast.uplink_share import LOW_SHARE
from broadcast.verdicts import (
    REFUSED,
    Flow,
    Pause,
    Probe,
    ReportGate,
    judge_report,
    prove,
    prove_target,
    recheck_reach,
)

from .engine import Host, Sim, Xfer

if TYPE_CHECKING:
    from .world import World


class SimClock:
    """The tracker's clock: the simulation's seconds."""

    def __init__(self, sim: Sim):
        self.sim = sim

    def monotonic(self) -> float:
        return self.sim.now

    def time(self) -> float:
        return self.sim.now


class SimOrigin:
    def __init__(self, sw: World, host: Host, cfg: OriginConfig, probes: bool = True, seed: str = ""):
        self.sw, self.host, self.cfg = sw, host, cfg
        self.url = ORIGIN
        ids = random.Random(f"simulated ids{seed}")  # not secrets: the same seed, the same run
        self.tracker = Tracker(ORIGIN, cfg.n_trees, cfg.fanout, cfg.heartbeat_s, clock=SimClock(sw.sim),
                               max_peers=1 << 20, order_key=f"simulated tracker{seed}".encode(),  # churn: N + arrivals
                               token_hex=lambda n: ids.randbytes(n).hex())
        self.turns = TurnQueue()  # its children's requests take turns, as a relay's
        host.low_share = LOW_SHARE  # members without standing share this much while others are sent to
        self.gate = ReportGate()
        self.plan = UplinkPlan(self.tracker) if probes else None  # None: no uplink probes
        self.probing: dict[str, tuple[PeerRec, Xfer | None]] = {}  # url -> (relay, its probe's transfer)
        self.latest_seen: int | None = None  # the tracker's version when running probes were last checked
        self.proving: dict[str, float] = {}
        self.rng = random.Random(0)
        sw.sim.after(cfg.heartbeat_s, self._reap)

    def _reap(self) -> None:
        self.tracker.reap()
        for rec in self.tracker.reach_rechecks():
            self.run(recheck_reach(self.tracker, rec), lambda _: None)
        self.sw.sim.after(self.cfg.heartbeat_s, self._reap)

    # -- what peers send (each call is the moment the request reaches the origin) -----------------------
    def join(self, url: str, name: str, key: str, addr: str = "", relay: bool = True) -> tuple[str, str]:
        """`relay`: False for a peer nobody can reach (a download-only leaf)."""
        if self.sw.trusted:  # honest keys with standing (established nodes), unless the run is of strangers
            self.tracker.set_trusted(key)
        j = self.tracker.join(Join(url, relay, name), key=key, observed_host=addr)
        return j.peer_id, j.token

    def heartbeat(self, msg: PeerHeartbeat, latest: int | None) -> TreeSources | None:
        """None: the tracker forgot the peer (404), which joins again."""
        try:
            ans = self.tracker.heartbeat(msg, latest)
        except TrackerError:
            return None
        rec = self.tracker.peers[msg.peer_id]
        pieces = {v: self.sw.n_pieces(v) for v in self.sw.sizes}
        target = prove_target(self.tracker, rec, pieces, self.proving, self.rng)
        if target is not None:
            self.run(prove(self.tracker, rec, *target), lambda _: None)
        self._probes_after(rec)
        return ans

    def leave(self, peer_id: str) -> None:
        self.tracker.remove(peer_id, "left")

    def report(self, peer_id: str, r: Report, answered: Callable[[str], None]) -> None:
        """A report reaches the origin; `answered(action)` once its verdict is in (at the origin)."""
        t = self.tracker
        reporter = t.peers.get(peer_id)
        if reporter is None:
            answered("unknown peer")
            return
        if (refused := self.gate.refusal(t, reporter)) is not None:
            answered(f"HTTP {refused[0]}")
            return
        accused = t.by_url(r.accused_url)
        if accused is None or accused is reporter:
            answered("none")
            return
        self.run(judge_report(t, reporter, accused, r, self._pieces), answered)

    def _pieces(self, version: int) -> int | None:
        return self.sw.n_pieces(version) if version in self.sw.sizes else None

    # -- verdicts on simulated probes --------------------------------------------------------------------
    def run(self, flow: Flow, done: Callable[[str], None], result: str | None = None) -> None:
        try:
            step = flow.send(result)
        except StopIteration as end:
            done(end.value)
            return
        sim = self.sw.sim
        if isinstance(step, Pause):
            sim.after(step.seconds, self.run, flow, done)
        elif isinstance(step, Probe):
            rtt, verdict = self._probe(step)
            sim.after(rtt, self.run, flow, done, verdict)
        else:  # the trainer's ban hook: no trainer here
            self.run(flow, done)

    def _probe(self, p: Probe) -> tuple[float, str]:
        """(when the answer is in, what it says): a live relay answers at once; a gone one refuses."""
        peer = self.sw.peers.get(p.rec.url or "")
        rtt = 2 * (self.host.lat + (peer.host.lat if peer else 0.0))
        alive = peer is not None and peer.host.alive
        if p.kind == "reach":
            return rtt, "ok" if alive else f"unreachable: {REFUSED}"  # a gone relay's port is closed
        if p.kind == "answers":
            return rtt, "answers" if alive else "dead"
        return rtt, ("ok" if peer is not None and peer.holds(p.version, p.index) else "unknown") if alive else "dead"

    # -- uplink probes -----------------------------------------------------------------------------------
    def _probes_after(self, rec: PeerRec) -> None:
        if self.plan is None:
            return
        t = self.tracker
        if t.latest != self.latest_seen:  # a version went out: probes of relays it gave children are given up
            self.latest_seen = t.latest
            for r, x in list(self.probing.values()):
                if x is not None and self.plan.preempted(r):
                    self.sw.net.cancel(x)
        self._start_probes(self.plan.after_heartbeat(rec))

    def _start_probes(self, recs: list[PeerRec]) -> None:
        for rec in recs:
            peer = self.sw.peers[rec.url or ""]
            self.probing[peer.url] = (rec, None)
            self.sw.sim.after(peer.host.lat + self.host.lat, self._probe_start, rec, peer, self.sw.sim.now)

    def _probe_start(self, rec: PeerRec, peer, asked: float) -> None:
        if not peer.host.alive:
            self._probe_end(rec, peer, asked, False)
            return
        x = self.sw.net.start(peer.host, self.host, PROBE_BYTES, lambda x, ok: self._probe_end(rec, peer, asked, ok))
        if x.live:
            self.probing[peer.url] = (rec, x)
            # The prober stops reading at PROBE_MAX_S after asking: what has arrived by then is the figure.
            self.sw.sim.at(asked + PROBE_MAX_S - peer.host.lat - self.host.lat, self._probe_cut, rec, peer, asked, x)

    def _probe_cut(self, rec: PeerRec, peer, asked: float, x) -> None:
        if x.live:
            got = x.done + x.rate * (self.sw.sim.now - x.t)
            x.on_end = lambda x, ok: self._probe_end(rec, peer, asked, ok, got)
            self.sw.net.cancel(x)

    def _probe_end(self, rec: PeerRec, peer, asked: float, ok: bool, cut: float | None = None) -> None:
        assert self.plan
        self.probing.pop(peer.url, None)
        ok = ok or (cut is not None and peer.host.alive)
        if ok:  # timed as the real prober times it: from sending the request to the last byte's arrival
            arrived = self.sw.sim.now + peer.host.lat + self.host.lat
            got = PROBE_BYTES if cut is None else cut
            more = self.plan.done(rec, peer.url, "probed", got / max(arrived - asked, 1e-3))
        else:
            more = self.plan.done(rec, peer.url, "preempted" if peer.host.alive else "failed")
        self._start_probes(more)


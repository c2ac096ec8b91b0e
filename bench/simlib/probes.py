"""The origin's uplink probes (broadcast/uplink_probe.py) in simulated time: the same rules, on the real
tracker, with a probe's 1 MiB as a transfer from the relay to the origin that shares both their links."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from broadcast.uplink_probe import MAX_IN_FLIGHT, PROBE_BYTES, wants_probe

if TYPE_CHECKING:
    from .engine import Xfer
    from .swarm import SimPeer, Swarm


class SimProber:
    """As origin.py's UplinkProber: after a heartbeat, a relay with standing that nothing has measured is
    timed while its uplink is idle (wants_probe), MAX_IN_FLIGHT at a time, and given up if a version goes
    out and gives it children. The figure is 1 MiB over the time from sending the request to the last
    byte's arrival, as the real prober times it (no slow start here: a fluid stream)."""

    def __init__(self, sw: Swarm) -> None:
        self.sw = sw
        self.pending: set[str] = set()  # urls queued or being probed
        self.queue: collections.deque[SimPeer] = collections.deque()
        self.running: dict[str, Xfer | None] = {}  # url -> its probe's transfer (None: the request on its way)
        self.latest: int | None = None  # the version the tracker knew when running probes were last checked

    def after_heartbeat(self, p: SimPeer) -> None:
        sw, tr = self.sw, self.sw.tracker
        if tr.latest != self.latest:  # a version went out: probes of relays it gave children are given up
            self.latest = tr.latest
            for url, x in list(self.running.items()):
                rec = tr.peers.get(sw.peers[url].pid)
                if x is not None and (rec is None or not wants_probe(tr, rec)):
                    sw.net.cancel(x)
        rec = tr.peers.get(p.pid)
        if rec is None or p.url in self.pending or not wants_probe(tr, rec):
            return
        self.pending.add(p.url)
        self.queue.append(p)
        self._next()

    def _next(self) -> None:
        sw = self.sw
        while len(self.running) < MAX_IN_FLIGHT and self.queue:
            p = self.queue.popleft()
            rec = sw.tracker.peers.get(p.pid)
            if p.host.alive and rec is not None and wants_probe(sw.tracker, rec):  # checked again, as origin.py
                self.running[p.url] = None
                sw.sim.after(p.host.lat + sw.origin.lat, self._start, p, sw.sim.now)  # the request's way
            else:
                self.pending.discard(p.url)

    def _start(self, p: SimPeer, asked: float) -> None:
        if not p.host.alive:
            self._end(p, asked, False)
            return
        x = self.sw.net.start(p.host, self.sw.origin, PROBE_BYTES, lambda x, ok: self._end(p, asked, ok))
        if x.live:
            self.running[p.url] = x

    def _end(self, p: SimPeer, asked: float, ok: bool) -> None:
        sw = self.sw
        self.running.pop(p.url, None)
        self.pending.discard(p.url)
        rec = sw.tracker.peers.get(p.pid)
        if ok and rec is not None and rec.url == p.url:
            arrived = sw.sim.now + p.host.lat + sw.origin.lat  # the last byte reaches the origin
            sw.tracker.probed(rec, PROBE_BYTES / max(arrived - asked, 1e-3))
        self._next()

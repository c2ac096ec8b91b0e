"""Which relays the origin times, when, and how many at once (sans-I/O): the origin's HTTP prober
(uplink_probe.py) and the simulator (bench/simlib) both drive this plan.

Without these probes a new swarm's first version ran on the join-order layout, slow home relays inside the
trees: in the 1000-peer simulation a 13.5 MB version took 25-215 s against a bound near 1.1 s; laid out by
the probes, 4.9-6.3 s (docs/tree-simulation.md, item 7). A relay with standing (placement counts no fresh
key's numbers) that nothing has measured yet is timed after a heartbeat, while its uplink is idle; the
figure stands in for its uplink until children measure it (upload_meter.UploadMeter).
"""

from __future__ import annotations

import collections

from .tracker import PeerRec, Tracker

PROBE_BYTES = 1 << 20
MAX_IN_FLIGHT = 16  # probes at once; they share the origin's downlink: at 1 Gbit/s, ~60 Mbit/s each
RETRY_S = 60.0  # a probe that failed (busy, timed out, refused) is tried again this much later
TIMEOUT_S = 30.0


def wants_probe(tracker: Tracker, rec: PeerRec) -> bool:
    """A relay whose uplink placement would use, that nothing has measured yet, and whose uplink is idle:
    no version is in flight, or it has no children now (a leaf uploads nothing). A probe of a relay that is
    serving measures its children's share and takes time from them: in the simulation, probes during a
    version measured such relays at a fifth of their uplink and slowed the version."""
    if (rec.reachable is not True or not rec.interior_capable or not tracker.has_standing(rec)  # capable: has a url
            or tracker.tier(rec) != 2  # while members vouch, a key holding the one-piece proof alone is on trial
            or rec.url in tracker.uploads.estimate or rec.url in tracker.uploads.probed):
        return False
    if not tracker.in_flight():
        return True
    children = tracker.topology()[1]
    return not any(children[t].get(rec.peer_id) for t in range(tracker.trees))


class UplinkPlan:
    def __init__(self, tracker: Tracker):
        self.tracker = tracker
        self.pending: set[str] = set()  # keys queued or being probed
        self.queue: collections.deque[PeerRec] = collections.deque()
        self.running = 0
        self.retry: dict[str, float] = {}  # key -> when a failed probe may be tried again
        self.counts = {"probed": 0, "failed": 0, "preempted": 0}

    def after_heartbeat(self, rec: PeerRec) -> list[PeerRec]:
        """-> the relays to start probing now."""
        now = self.tracker.clock.monotonic()
        if rec.key in self.pending or self.retry.get(rec.key, 0.0) > now or not wants_probe(self.tracker, rec):
            return []
        self.pending.add(rec.key)
        self.queue.append(rec)
        return self._next()

    def _next(self) -> list[PeerRec]:
        out = []
        while self.running < MAX_IN_FLIGHT and self.queue:
            rec = self.queue.popleft()
            # Checked again: it left, or serves a version that went out meanwhile (asked after a later heartbeat).
            if self.tracker.peers.get(rec.peer_id) is rec and wants_probe(self.tracker, rec):
                self.running += 1
                out.append(rec)
            else:
                self.pending.discard(rec.key)
        return out

    def preempted(self, rec: PeerRec) -> bool:
        """A version went out during the probe and gives the relay children: its uplink is theirs now."""
        return not wants_probe(self.tracker, rec)

    def done(self, rec: PeerRec, url: str, outcome: str, rate: float = 0.0) -> list[PeerRec]:
        """A probe ended: 'probed' (at `rate` bytes/s), 'failed' or 'preempted'. -> the relays to start now."""
        self.running -= 1
        self.pending.discard(rec.key)
        self.counts[outcome] += 1
        if outcome == "failed":
            now = self.tracker.clock.monotonic()
            self.retry[rec.key] = now + RETRY_S
            if len(self.retry) > 4 * self.tracker.max_peers:
                self.retry = {k: t for k, t in self.retry.items() if t > now}
        elif outcome == "probed" and self.tracker.peers.get(rec.peer_id) is rec and rec.url == url:
            self.tracker.probed(rec, rate)
        return self._next()

"""Which relays the origin times, when, and how many at once (sans-I/O): the origin's HTTP prober
(uplink_probe.py) and the simulator (bench/simlib) both drive this plan.

Without these probes a new swarm's first version ran on the join-order layout, slow home relays inside the
trees: in the 1000-peer simulation a 13.5 MB version took 25-215 s against a bound near 1.1 s; laid out by
the probes, 4.9-6.3 s (docs/tree-simulation.md, item 7). A relay with standing (placement counts no fresh
key's numbers) that nothing has measured yet is timed after a heartbeat, while its uplink is idle; the
figure stands in for its uplink until children measure it (upload_meter.UploadMeter).

The probes in flight share the origin's downlink, so a fast relay shows the origin's share, not its own
uplink: in the simulation, 16 at once over a 1 Gbit/s downlink timed relays of 150-1000 Mbit/s at a median
51-60 Mbit/s, the fast relays looked like office ones, the layout's per-child rate fell, 7 Mbit/s home relays
were given children, and a new swarm's first version with every relay probed took 5.0x its bound (1.6x with
exact figures). So once no relay waits for a first probe, those whose figure times the probes that ran beside
it came near what the origin takes in (PRECISE_SHARE of it: the figures held to a share) are timed once more,
PRECISE_IN_FLIGHT at a time, and that figure replaces the first. And a probe reads for PROBE_MAX_S at most,
so slow relays hold the probes' places less long (docs/tree-simulation.md has the figures). A probe's time
includes a round trip, as children's timings of pieces do: taken off, the first version came closer to its
bound but the figures outranked children's and later versions were slower.
"""

from __future__ import annotations

import collections

from .tracker import PeerRec, Tracker

PROBE_BYTES = 1 << 20
PROBE_MAX_S = 0.5  # or until then: a 5 Mbit/s relay's 1 MiB held one of the probes' places 1.7 s
MAX_IN_FLIGHT = 16  # probes at once; they share the origin's downlink: at 1 Gbit/s, ~60 Mbit/s each
RETRY_S = 60.0  # a probe that failed (busy, timed out, refused) is tried again this much later
TIMEOUT_S = 30.0
PRECISE_SHARE = 0.7  # of the origin's intake: a first figure this near it is timed again, alone
PRECISE_IN_FLIGHT = 1  # alone: a figure is then held to no less than the origin's whole downlink


def wants_probe(tracker: Tracker, rec: PeerRec, again: bool = False) -> bool:
    """A relay whose uplink placement would use, that nothing has measured yet (`again`: that only a first
    probe has), and whose uplink is idle: no version is in flight, or it has no children now (a leaf uploads
    nothing). A probe of a relay that is serving measures its children's share and takes time from them: in
    the simulation, probes during a version measured such relays at a fifth of their uplink and slowed it."""
    if (rec.reachable is not True or not rec.interior_capable or not tracker.has_standing(rec)  # capable: has a url
            or tracker.tier(rec) != 2  # while members vouch, a key holding the one-piece proof alone is on trial
            or rec.url in tracker.uploads.estimate or (rec.url in tracker.uploads.probed) != again):
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
        self.again: set[str] = set()  # keys whose second probe is running
        self.first: dict[str, tuple[float, int]] = {}  # url -> a first figure and the probes running with it
        self.timed_again: set[str] = set()  # urls given their second probe
        self.beside: dict[str, int] = {}  # running key -> the most probes running at once while it ran

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
        while self.running < MAX_IN_FLIGHT and self.queue and not self.again:
            rec = self.queue.popleft()
            # Checked again: it left, or serves a version that went out meanwhile (asked after a later heartbeat).
            if self.tracker.peers.get(rec.peer_id) is rec and wants_probe(self.tracker, rec):
                self._started(rec)
                out.append(rec)
            else:
                self.pending.discard(rec.key)
        if not self.queue and self.running == len(self.again):  # no first probe waits or runs: the second ones
            out += self._again(PRECISE_IN_FLIGHT - self.running)
        return out

    def _again(self, room: int) -> list[PeerRec]:
        """Relays to time a second time, at most PRECISE_IN_FLIGHT probes running: those whose first figure,
        times the probes that ran beside it, came near what the origin takes in (the figures held to a share
        of its downlink), highest first."""
        if room <= 0 or not self.first:
            return []
        intake = sorted(f * k for f, k in self.first.values())
        floor = PRECISE_SHARE * intake[int(0.9 * (len(intake) - 1))]  # the origin's intake, robust to a few
        due = sorted((u for u, (f, k) in self.first.items() if f * k >= floor and u not in self.timed_again),
                     key=lambda u: -self.first[u][0])
        out = []
        for url in due:
            rec = self.tracker.by_url(url)
            if rec is None or rec.key in self.pending or not wants_probe(self.tracker, rec, True):
                continue
            self.timed_again.add(url)
            self.pending.add(rec.key)
            self.again.add(rec.key)
            self._started(rec)
            out.append(rec)
            if len(out) == room:
                break
        return out

    def _started(self, rec: PeerRec) -> None:
        self.running += 1
        self.beside[rec.key] = 0
        for k in self.beside:  # the running ones: each keeps the most that ran at once beside it
            self.beside[k] = max(self.beside[k], self.running)

    def preempted(self, rec: PeerRec) -> bool:
        """A version went out during the probe and gives the relay children: its uplink is theirs now."""
        return not wants_probe(self.tracker, rec, rec.key in self.again)

    def done(self, rec: PeerRec, url: str, outcome: str, rate: float = 0.0) -> list[PeerRec]:
        """A probe ended: 'probed' (at `rate` bytes/s), 'failed' or 'preempted'. -> the relays to start now."""
        self.running -= 1
        self.pending.discard(rec.key)
        first = rec.key not in self.again
        self.again.discard(rec.key)
        beside = self.beside.pop(rec.key, 1)
        self.counts[outcome] += 1
        if outcome == "failed":
            now = self.tracker.clock.monotonic()
            self.retry[rec.key] = now + RETRY_S
            if len(self.retry) > 4 * self.tracker.max_peers:
                self.retry = {k: t for k, t in self.retry.items() if t > now}
        elif outcome == "probed" and self.tracker.peers.get(rec.peer_id) is rec and rec.url == url:
            self.tracker.probed(rec, rate)
            if first:
                self.first[url] = (rate, beside)
                if len(self.first) > 4 * self.tracker.max_peers:
                    self.first = {u: v for u, v in self.first.items() if self.tracker.by_url(u) is not None}
                    self.timed_again &= self.first.keys()
        return self._next()

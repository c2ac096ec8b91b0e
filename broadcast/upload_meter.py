"""Children's reports -> each relay's uplink figure, for placement (broadcast/placement.py).

A relay's uplink is never taken from what it claims. Each child reports, per source, the bytes of verified
pieces it received and the seconds it spent receiving them (receive_meter.py); the tracker credits a source
with what those reports prove it uploaded. Figures are frozen when a new version appears, so the layout
holds still while a version is in flight. Where nobody vouches (strangers alone), no reporter's word is
believed alone: a relay's figure is what most of the children it was given saw (`UploadMeter.by_children`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import msgspec

log = logging.getLogger("broadcast.upload_meter")
MIN_BYTES = 16 << 10  # smaller reports say more about latency than about bandwidth
MIN_SECONDS = 0.005
STALLED_S = 1.0  # children that waited this long on a source for less than MIN_BYTES: measured at that rate
IDLE_RATE = MIN_BYTES / STALLED_S  # bytes/s: a relay measured below this sends next to nothing (a leaf)
SILENT_RATE = 1.0  # bytes/s: the figure of a source its children waited on for nothing (a leaf at any r)
MAX_RATE = 100e9 / 8  # no child sees more than 100 Gbit/s from one source
MAX_SOURCES = 4096  # sources tracked per version (reports name at most 64 each)


class UploadMeter:
    """Children's reports -> uplink estimates per source URL (the origin's included).

    Per source and child, this version's bytes and seconds receiving are summed; one report's ratio is no
    rate (a stream that spans two reports puts its bytes in one and most of its seconds in the other), a
    child's totals are. Its total rate is a lower bound on the source's uplink (one child's streams can't
    beat it), but a loose one in a tree: a relay sends each piece to its c children at once, each sees
    about u/c. The estimate is the rate while sending: all children's bytes over the longest time any one
    child spent receiving from the source. That is the uplink when the children's streams overlap, as they
    do below a relay, and more when they did not; a relay credited with more than it has gets children it
    then serves slower, and the next version's estimate (they start afresh each version) corrects it.
    Measured in the 1000-peer simulation: per-report maxima credited relays with 61% of their uplinks and
    up to 2x for some; this, with a median of 1.00 (docs/tree-simulation.md)."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self._seen: dict[str, dict[str, list[float]]] = {}  # source url -> child -> [bytes, seconds]
        self._counting: set[str] = set()  # children whose figures count (as of their latest report)
        self.majority = False  # nobody vouches: a figure is what most of its children saw (`by_children`)
        self._heard: set[str] = set()  # children who reported on any source this version (a sample)
        self._given: dict[str, dict[str, None]] = {}  # relay url -> the children it had while a version flew
        self.sampled: dict[str, int] = {}  # relay url -> how many children its figure came from (`limit`)
        self.estimate: dict[str, float] = {}  # source url -> latest uplink estimate
        self.placed: dict[str, float] = {}  # the estimates the current layout uses
        self.probed: dict[str, float] = {}  # the origin's own timing of relays no child has measured yet

    def note(self, received: dict, reporter: str = "", counts: bool = True, majority: bool = False) -> None:
        """`counts`: the reporter's figures count now (it has standing). Those it sent before they counted are
        kept and count from then on, within the version: strangers earn the origin's proof only once they hold
        a whole version, and their reports of the first version were all dropped, so the second was laid out
        knowing nothing of them (bench/tree_attacks_sim.py --strangers). `majority`: nobody vouches, and a
        source's figure is what most of its children saw (`by_children`), set when the version ends."""
        self.majority = majority
        if received and (reporter in self._heard or len(self._heard) < MAX_SOURCES):
            self._heard.add(reporter)
        if counts and (reporter in self._counting or len(self._counting) < MAX_SOURCES):
            self._counting.add(reporter)
        elif not counts:
            self._counting.discard(reporter)
        for url, r in list(received.items())[:64]:
            if r.bytes < 0 or r.seconds <= 0:  # 0 bytes: it answered, then sent nothing that long
                continue
            if url not in self._seen and len(self._seen) >= MAX_SOURCES:
                continue
            children = self._seen.setdefault(url, {})
            if reporter not in children and len(children) >= 256:
                continue
            tot = children.setdefault(reporter, [0.0, 0.0])
            tot[0] += r.bytes
            tot[1] += r.seconds
            if counts and not majority:  # (where nobody vouches, only `by_children` sets figures)
                self._figure(url)

    def _figure(self, url: str) -> None:
        children = [t for k, t in self._seen.get(url, {}).items() if k in self._counting]
        if not children:
            return
        sent = sum(b for b, _ in children)
        if sent < MIN_BYTES:
            waited = max(sec for _, sec in children)
            if waited >= STALLED_S:  # its children waited on it and got next to nothing: a trickle
                # (issue 29: slow-loris), measured so; or nothing at all (a silent key): never 0, which
                # reads as "not measured yet" and placed it inside the trees again
                self.estimate[url] = max(sent / waited, SILENT_RATE)
            return
        longest = max(max(sec for _, sec in children), MIN_SECONDS)
        best = max(b / max(sec, MIN_SECONDS) for b, sec in children)
        self.estimate[url] = min(max(best, sent / longest), MAX_RATE)

    def note_parents(self, child: str, urls: set[str]) -> None:
        """The tracker gave `child` these parents while a version was in flight."""
        for url in urls:
            if url not in self._given and len(self._given) >= MAX_SOURCES:
                continue
            given = self._given.setdefault(url, {})
            if len(given) < 256:
                given[child] = None

    def by_children(self, url: str, children: list[str]) -> float:
        """Where nobody vouches: c times what a strict majority of the c children the layout gave a relay in
        the version saw from it (a child that got nothing from it counts 0; each sees about 1/c of an uplink
        they share). Among strangers every key that showed the origin a piece reports, and ten keys said they
        got each other's pieces at 12.5 GB/s: by the best reporter's figure they took the top of every tree
        (issue 29, credit from friends). The tracker chose the children, so friends are most of a relay's
        children only by chance, and a key lifted so gets many children the next version, most of them not
        its friends, whose figures bring it down again. Never below SILENT_RATE (0 reads as not measured)."""
        seen = self._seen.get(url, {})
        rates = sorted(b / max(sec, MIN_SECONDS) if b > 0 else 0.0
                       for b, sec in (seen.get(k, (0.0, 0.0)) for k in children))
        return max(SILENT_RATE, min(len(rates) * rates[(len(rates) - 1) // 2], MAX_RATE))

    def limit(self, url: str) -> int | None:
        """Where nobody vouches, a relay measured by c children gets at most 2c the next version (None: no
        limit but max_children's): the friends who made up one of their own's children made it head a tree
        of 31 the next version, all waiting on it; doubled each version, a relay's place grows with what
        children have seen of it, and a mistake costs a few children one version."""
        n = self.sampled.get(url) if self.majority else None
        return 2 * n if n else None

    def note_probe(self, url: str, rate: float) -> None:
        """The origin timed a download from `url` (broadcast/uplink_probe.py): a lower bound on its uplink,
        used until a version's children measure it. Not frozen with the estimates: a layout is made between
        versions or for a new one, never mid-version, so no probe moves anyone while a version is in flight."""
        if len(self.probed) < MAX_SOURCES or url in self.probed:
            self.probed[url] = min(max(rate, 0.0), MAX_RATE)

    def idle(self, url: str) -> bool:
        """Measured by its children as sending next to nothing (a leaf to all, or a key that gives none)."""
        figure = self.placed.get(url)
        return figure is not None and figure < IDLE_RATE

    def uplink(self, url: str) -> float | None:
        return self.placed.get(url) or self.probed.get(url)

    def dump(self) -> bytes:
        """The figures placement would use, for the next start of this origin (uplink_probe.UPLINKS_FILE)."""
        return msgspec.json.encode({**self.probed, **self.estimate})

    def restore(self, path: Path) -> int:
        """A restarted origin's swarm rejoins at the same addresses: last run's figures stand in for probes
        until children measure them again. The file is ours, but read as untrusted as anything on disk."""
        try:
            if not path.exists() or path.stat().st_size > 1 << 20:
                return 0
            figures = msgspec.json.decode(path.read_bytes(), type=dict[str, float])
        except (OSError, msgspec.DecodeError) as e:
            log.warning("ignoring the uplink figures in %s: %s", path, e)
            return 0
        ok = {u: r for u, r in figures.items() if len(u) <= 512 and math.isfinite(r) and 0 < r <= MAX_RATE}
        for url, rate in list(ok.items())[:MAX_SOURCES]:
            self.probed.setdefault(url, rate)
        return min(len(ok), MAX_SOURCES)

    def new_epoch(self, epoch: int, live_urls: set[str]) -> bool:
        """A new version: freeze the estimates for the layout; True if they changed."""
        if epoch == self.epoch:
            return False
        self.epoch = epoch
        for url in self._seen if not self.majority else ():  # with what children who count only now reported
            self._figure(url)
        for url, children in self._given.items() if self.majority else ():
            if sample := [k for k in children if k in self._counting and k in self._heard]:
                self.estimate[url] = self.by_children(url, sample)
                self.sampled[url] = len(sample)
        self._seen.clear()
        self._counting.clear()
        self._heard.clear()
        self._given.clear()
        self.estimate = {u: e for u, e in self.estimate.items() if u in live_urls}
        self.probed = {u: e for u, e in self.probed.items() if u in live_urls}
        self.sampled = {u: n for u, n in self.sampled.items() if u in live_urls}
        changed = self.placed != self.estimate
        self.placed = dict(self.estimate)
        return changed

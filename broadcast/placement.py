"""Bandwidth-aware placement: which tree each relay is interior in, and who is whose parent.

A relay's uplink is never taken from what it claims. Each child reports, per source, the bytes of verified
pieces it received and the seconds it spent receiving them; the tracker credits a source with what those
reports prove it uploaded (UploadMeter). Estimates are frozen when a new version appears, so the layout
holds still while a version is in flight.

With estimates, every measured relay gets children in proportion to its uplink: c_v = min(u_v // r, cap)
children, where r, the rate each child should get, is the largest one for which every tree has a place for
every peer. Fast relays sit highest (fewest hops), relays too slow for one child at r are leaves everywhere,
and relays not yet measured (newcomers) sit below the measured ones, used only where places run short.
Without any estimate the tracker keeps its join-order SplitStream layout.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import msgspec

from .trials import TRIAL_CHILDREN

log = logging.getLogger("broadcast.placement")
MIN_BYTES = 16 << 10  # smaller reports say more about latency than about bandwidth
MIN_SECONDS = 0.005
STALLED_S = 1.0  # children that waited this long on a source for less than MIN_BYTES: measured at that rate
MAX_RATE = 100e9 / 8  # no child sees more than 100 Gbit/s from one source
MAX_SOURCES = 4096  # sources tracked per version (reports name at most 64 each)
HEADROOM = 0.1  # places for peers arriving, or moved, while a version is in flight


@dataclass
class Candidate:
    peer_id: str
    url: str | None
    capable: bool  # may be interior (relays, reachable, not demoted)
    group: int | None  # the tree the join code put it in
    uplink: float | None  # bytes/s measured, None if not yet
    trial: bool = False  # on trial (trials.py): below the others, never the origin's child, TRIAL_CHILDREN at most


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
        self.estimate: dict[str, float] = {}  # source url -> latest uplink estimate
        self.placed: dict[str, float] = {}  # the estimates the current layout uses
        self.probed: dict[str, float] = {}  # the origin's own timing of relays no child has measured yet

    def note(self, received: dict, reporter: str = "") -> None:
        for url, r in list(received.items())[:64]:
            if r.bytes <= 0 or r.seconds <= 0:
                continue
            if url not in self._seen and len(self._seen) >= MAX_SOURCES:
                continue
            children = self._seen.setdefault(url, {})
            if reporter not in children and len(children) >= 256:
                continue
            tot = children.setdefault(reporter, [0.0, 0.0])
            tot[0] += r.bytes
            tot[1] += r.seconds
            sent = sum(b for b, _ in children.values())
            if sent < MIN_BYTES:
                waited = max(sec for _, sec in children.values())
                if waited >= STALLED_S:  # its children waited on it and got next to nothing: a trickle
                    self.estimate[url] = sent / waited  # (issue 29: slow-loris), measured so
                continue
            longest = max(max(sec for _, sec in children.values()), MIN_SECONDS)
            best = max(b / max(sec, MIN_SECONDS) for b, sec in children.values())
            self.estimate[url] = min(max(best, sent / longest), MAX_RATE)

    def note_probe(self, url: str, rate: float) -> None:
        """The origin timed a download from `url` (broadcast/uplink_probe.py): a lower bound on its uplink,
        used until a version's children measure it. Not frozen with the estimates: a layout is made between
        versions or for a new one, never mid-version, so no probe moves anyone while a version is in flight."""
        if len(self.probed) < MAX_SOURCES or url in self.probed:
            self.probed[url] = min(max(rate, 0.0), MAX_RATE)

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
        self._seen.clear()
        self.estimate = {u: e for u, e in self.estimate.items() if u in live_urls}
        self.probed = {u: e for u, e in self.probed.items() if u in live_urls}
        changed = self.placed != self.estimate
        self.placed = dict(self.estimate)
        return changed


def max_children(fanout: int) -> int:
    return 16 * fanout  # bounds how many peers one departure re-parents


def _rate_target(members: list[list[float]], n: int, origin_per_tree: float | None, cap: int,
                 fixed: list[int]) -> float:
    """The largest per-child rate r with room for all n peers in every tree (bisection in log space);
    `fixed`: places per tree that do not depend on r (relays not measured yet)."""

    def fits(r: float) -> bool:
        for ups, extra in zip(members, fixed, strict=True):
            slots = max(1, int(origin_per_tree // r)) if origin_per_tree else 1
            slots += extra + sum(min(int(u // r), cap) for u in ups)
            if slots < n:
                return False
        return True

    lo, hi = 1e3, MAX_RATE
    if not fits(lo):
        return lo
    for _ in range(50):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def measured_layout(cands: list[Candidate], trees: int, fanout: int, origin_uplink: float | None,
                    others: int = 0):
    """-> (group per peer_id, and per tree: parents, children, how many children each may have). `cands` in
    join order; `others`: peers hung in the spare places afterwards (fresh keys, as leaves)."""
    cap = max_children(fanout)
    measured = sorted((c for c in cands if c.capable and c.uplink), key=lambda c: -c.uplink)
    load = [0.0] * trees
    group: dict[str, int | None] = {c.peer_id: None for c in cands}
    for c in measured:  # greedy: the fastest first, each to the tree with the least uplink so far
        t = load.index(min(load))
        group[c.peer_id] = t
        load[t] += c.uplink
    per_tree = [[c.uplink for c in measured if group[c.peer_id] == t] for t in range(trees)]
    origin_per_tree = origin_uplink / trees if origin_uplink else None
    newcomers = [c for c in cands if c.capable and not c.uplink and c.group is not None]
    # Relays not measured yet take `fanout` children, whatever r is: their places count (without them,
    # r fell until the origin alone had room for everyone, a star in which they could never be measured).
    fixed = [sum(TRIAL_CHILDREN if c.trial else fanout for c in newcomers if c.group == t) for t in range(trees)]
    # The layout fills places at the rate r that fits everyone; repairs may fill up to the places at the
    # lower rate that fits 10% more (a relay with spare places gives its children more than r meanwhile).
    r = _rate_target(per_tree, len(cands), origin_per_tree, cap, fixed)
    n_room = int((len(cands) + others) * (1 + HEADROOM)) + 1
    r_room = _rate_target(per_tree, n_room, origin_per_tree, cap, fixed)
    slots = {c.peer_id: min(int(c.uplink // r), cap) for c in measured}
    room = {c.peer_id: min(int(c.uplink // r_room), cap) for c in measured}
    for c in measured:
        if slots[c.peer_id] == 0:
            group[c.peer_id] = None  # too slow to give even one child the target rate: a leaf everywhere
    for c in newcomers:
        group[c.peer_id] = c.group
        slots[c.peer_id] = room[c.peer_id] = TRIAL_CHILDREN if c.trial else fanout
    origin_slots = max(1, int(origin_per_tree // r)) if origin_per_tree else 1
    origin_room = max(1, int(origin_per_tree // r_room)) if origin_per_tree else 1
    parents: list[dict[str, str | None]] = []
    children: list[dict[str | None, list[str]]] = []
    caps: list[dict[str | None, int]] = []
    for t in range(trees):
        first = [c.peer_id for c in measured if group[c.peer_id] == t] + [
            c.peer_id for c in newcomers if group[c.peer_id] == t and not c.trial]
        inner = first + [c.peer_id for c in newcomers if group[c.peer_id] == t and c.trial]
        par, kids = _one_tree(inner, [c.peer_id for c in cands], slots, origin_slots, len(first))
        parents.append(par)
        children.append(kids)
        cap: dict[str | None, int] = {c.peer_id: 0 for c in cands}
        cap.update({pid: room[pid] for pid in inner})
        cap[None] = max(origin_room, len(kids.get(None, ())))
        caps.append(cap)
    return group, parents, children, caps


def _one_tree(inner: list[str], everyone: list[str], slots: dict[str, int], origin_slots: int,
              n_first: int | None = None):
    """Breadth first from the origin: interior peers in the order given (fastest first), then the rest.
    Relays on trial (`inner` after the first `n_first`) take no place of the origin's while a relay has one."""
    par: dict[str, str | None] = {}
    kids: dict[str | None, list[str]] = collections.defaultdict(list)
    free: collections.deque[list] = collections.deque([[None, origin_slots]])
    n_inner = len(inner)
    n_first = n_inner if n_first is None else n_first
    for j, pid in enumerate([*inner, *everyone]):
        if pid in par:
            continue
        while free and free[0][1] == 0:
            free.popleft()
        place = free[0] if free else None
        if place is not None and place[0] is None and n_first <= j < n_inner:
            place = next((f for f in free if f[0] is not None and f[1] > 0), place)
        parent = place[0] if place else None  # no room left: the origin takes it
        if place:
            place[1] -= 1
        par[pid] = parent
        kids[parent].append(pid)
        if j < n_inner:  # an interior peer opens its own places for those after it
            free.append([pid, slots[pid]])
    return par, dict(kids)

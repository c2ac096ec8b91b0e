"""Bandwidth-aware placement: which tree each relay is interior in, and who is whose parent.

A relay's uplink is never taken from what it claims: the figures come from its children's reports
(upload_meter.UploadMeter), frozen when a new version appears, so the layout holds still while a version is
in flight.

With estimates, every measured relay gets children in proportion to its uplink: c_v = min(u_v // r, cap)
children, where r, the rate each child should get, is the largest one for which every tree has a place for
every peer first in its uplinks' line (uplink_line.py; the others hang in the places left, where the most
uplink is left over). Fast relays sit highest (fewest hops; where nobody vouches, those at or above the
median figure are equals), relays too slow for one child at r are leaves everywhere,
and relays not yet measured (newcomers) sit below the measured ones, used only where places run short.
Without any estimate the tracker keeps its join-order SplitStream layout.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

from .trials import TRIAL_CHILDREN
from .upload_meter import MAX_RATE

log = logging.getLogger("broadcast.placement")
HEADROOM = 0.1  # places for peers arriving, or moved, while a version is in flight
FLOOR_RATE = 1e3  # bytes/s: the lowest per-child rate a layout is made for
NEWCOMER_QUANTILE = 0.25  # a relay not measured yet is given the places this quantile of the figures can carry ...
NEWCOMER_MIN_MEASURED = 8  # ... once this many relays are measured (before, `fanout` places)


@dataclass
class Candidate:
    peer_id: str
    url: str | None
    capable: bool  # may be interior (relays, reachable, not demoted)
    group: int | None  # the tree the join code put it in
    uplink: float | None  # bytes/s measured, None if not yet
    trial: bool = False  # on trial (trials.py): below the others, never the origin's child, TRIAL_CHILDREN at most
    limit: int | None = None  # children it may have at most (None: max_children); UploadMeter.limit
    low: bool = False  # not first in line (uplink_line.py): sent to from what the others leave


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[int(q * (len(xs) - 1))]


def max_children(fanout: int) -> int:
    return 16 * fanout  # bounds how many peers one departure re-parents


def _fits(members: list[list[tuple[float, int]]], n: int, origin_per_tree: float | None,
          fixed: Callable[[float], list[int]], r: float) -> bool:
    """Room for all n peers in every tree at r bytes/s per child? `fixed`: places per tree at r of the relays
    not measured yet."""
    for ups, extra in zip(members, fixed(r), strict=True):
        slots = max(1, int(origin_per_tree // r)) if origin_per_tree else 1
        slots += extra + sum(min(int(u // r), cap) for u, cap in ups)
        if slots < n:
            return False
    return True


def _rate_target(members: list[list[tuple[float, int]]], n: int, origin_per_tree: float | None,
                 fixed: Callable[[float], list[int]]) -> float:
    """The largest per-child rate r with room for all n peers in every tree (bisection in log space)."""
    lo, hi = FLOOR_RATE, MAX_RATE
    if not _fits(members, n, origin_per_tree, fixed, lo):
        return lo
    for _ in range(50):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if _fits(members, n, origin_per_tree, fixed, mid) else (lo, mid)
    return lo


def _usable(c: Candidate, most: int, median: float, fanout: int) -> float:
    """What of c's uplink its places can carry, as the trees are balanced by: a relay with a limit on its
    children (UploadMeter.limit, where nobody vouches) can use no more than that many children at the rate a
    relay of the median figure gives each of its `fanout`. Ten keys lifting one of their own to 12.5 GB/s
    made its tree hold it alone, and the origin the parent of the other 84 of 100 in that tree (its 8
    children were all it could take): a version 23x as long (bench/tree_attacks_sim.py --strangers)."""
    if c.limit is None:
        return c.uplink or 0.0
    return min(c.uplink or 0.0, most * median / fanout)


def _balance(measured: list[Candidate], most: dict[str, int], trees: int, fanout: int, median: float):
    """-> (tree per measured relay, per tree: (uplink, children it may have) of its relays). Greedy: the
    fastest first, each to the tree with the least uplink so far."""
    load = [0.0] * trees
    group: dict[str, int] = {}
    for c in measured:
        t = load.index(min(load))
        group[c.peer_id] = t
        load[t] += _usable(c, most[c.peer_id], median, fanout)
    return group, [[(c.uplink, most[c.peer_id]) for c in measured if group[c.peer_id] == t] for t in range(trees)]


def measured_layout(cands: list[Candidate], trees: int, fanout: int, origin_uplink: float | None,
                    others: int = 0):
    """-> (group per peer_id, and per tree: parents, children, how many children each may have). `cands` in
    join order; `others`: peers hung in the spare places afterwards (fresh keys, as leaves)."""
    cap = max_children(fanout)
    measured = sorted((c for c in cands if c.capable and c.uplink), key=lambda c: -c.uplink)
    median = measured[len(measured) // 2].uplink if measured else 0.0
    limited = any(c.limit for c in measured)  # nobody vouches (UploadMeter.limit)
    if limited:
        # Nobody vouches: a figure is what most of a relay's few children saw, and by chance most of them
        # can be friends of its own. Above the median figure, relays are equals, in the members' keyed order:
        # the fastest first put a key its friends had lifted to 12.5 GB/s at the top of every tree, and the
        # second version of N = 300 strangers waited on those silent roots for 264 s, 26x
        # (bench/tree_attacks_sim.py --n 300 --strangers --attack friends).
        order = {c.peer_id: i for i, c in enumerate(cands)}
        measured = sorted(measured, key=lambda c: (-min(c.uplink, median), order[c.peer_id]))
    newcomers = [c for c in cands if c.capable and not c.uplink and c.group is not None]
    n_room = int((len(cands) + others) * (1 + HEADROOM)) + 1
    # The rate each child should get is set by those first in line: the rest (keys that take every version
    # and give none, where nobody vouches) are sent to from what those leave, so they need places, not a
    # share. Counted alike, a third of the swarm that sent nothing put 12-13 children under each honest relay
    # and every version of N = 100 strangers at 2.3-2.8x, uplinks 41% used (bench/tree_attacks_sim.py).
    n_in_line = sum(1 for c in cands if not c.low)  # (fresh keys, `others`, hang in the room left, as before)
    origin_per_tree = origin_uplink / trees if origin_uplink else None
    # Relays not measured yet have places: without them, r fell until the origin alone had room for
    # everyone, a star in which they could never be measured. Once a few relays are measured, a newcomer
    # gets what a relay of their lower quartile could carry at r (at most `fanout`): given `fanout`
    # whatever r was, the newcomers' places let r rise until every newcomer, 6 Mbit/s home relays among
    # them, had four children at a per-child rate set by the fast measured ones, and their subtrees waited
    # (a new swarm's first version in the 1000-peer simulation: 21-27 s, 18-23 s so; docs/tree-simulation.md).
    prior = _quantile([c.uplink for c in measured], NEWCOMER_QUANTILE) if len(measured) >= NEWCOMER_MIN_MEASURED else None

    def places(r: float) -> int:  # of a newcomer not on trial
        return fanout if prior is None else min(fanout, int(prior // r))

    on_trial = [sum(TRIAL_CHILDREN for c in newcomers if c.group == t and c.trial) for t in range(trees)]
    untried = [sum(1 for c in newcomers if c.group == t and not c.trial) for t in range(trees)]

    def fixed(r: float) -> list[int]:
        return [a + n * places(r) for a, n in zip(on_trial, untried, strict=True)]

    # Children each may have: max_children, or less where UploadMeter.limit says so. Limits that leave no
    # room for everyone are raised together (twice each, four times...) until they do: the origin takes what
    # finds no place, and after a first version of strangers in which most relays were measured by two or
    # three children, it was the parent of 8-16 peers in every tree (bench/tree_attacks_sim.py --strangers).
    for scale in (1, 2, 4, 8, 16, cap):
        most = {c.peer_id: min(cap, c.limit * scale) if c.limit else cap for c in measured}
        tree_of, per_tree = _balance(measured, most, trees, fanout, median)
        if not limited or _fits(per_tree, n_room, origin_per_tree, fixed, FLOOR_RATE):
            break
    group: dict[str, int | None] = {c.peer_id: tree_of.get(c.peer_id) for c in cands}
    # The layout fills places at the rate r that fits everyone; repairs may fill up to the places at the
    # lower rate that fits 10% more (a relay with spare places gives its children more than r meanwhile).
    r = _rate_target(per_tree, n_in_line, origin_per_tree, fixed)
    r_room = _rate_target(per_tree, n_room, origin_per_tree, fixed)
    slots = {c.peer_id: min(int(c.uplink // r), most[c.peer_id]) for c in measured}
    room = {c.peer_id: min(int(c.uplink // r_room), most[c.peer_id]) for c in measured}
    for c in measured:
        if slots[c.peer_id] == 0:
            group[c.peer_id] = None  # too slow to give even one child the target rate: a leaf everywhere
    for c in newcomers:
        group[c.peer_id] = c.group
        slots[c.peer_id], room[c.peer_id] = (TRIAL_CHILDREN, TRIAL_CHILDREN) if c.trial else (places(r), places(r_room))
    uplink = {c.peer_id: c.uplink for c in measured}
    low = [c.peer_id for c in cands if c.low]
    everyone = [c.peer_id for c in cands if not c.low] + low  # those first in line take places first
    origin_slots = max(1, int(origin_per_tree // r)) if origin_per_tree else 1
    origin_room = max(1, int(origin_per_tree // r_room)) if origin_per_tree else 1
    parents: list[dict[str, str | None]] = []
    children: list[dict[str | None, list[str]]] = []
    caps: list[dict[str | None, int]] = []
    for t in range(trees):
        first = [c.peer_id for c in measured if group[c.peer_id] == t] + [
            c.peer_id for c in newcomers if group[c.peer_id] == t and not c.trial]
        inner = first + [c.peer_id for c in newcomers if group[c.peer_id] == t and c.trial]
        # The places beyond the rate's, most uplink left over at r first: those in them get what it leaves.
        spare = sorted(([pid, room[pid] - slots[pid]] for pid in inner if room[pid] > slots[pid]),
                       key=lambda s: -(uplink.get(s[0], 0.0) - slots[s[0]] * r))
        if origin_room > origin_slots:
            spare.append([None, origin_room - origin_slots])
        par, kids = _one_tree(inner, everyone, slots, origin_slots, len(first), spare, len(low))
        parents.append(par)
        children.append(kids)
        cap: dict[str | None, int] = {c.peer_id: 0 for c in cands}
        cap.update({pid: room[pid] for pid in inner})
        cap[None] = max(origin_room, len(kids.get(None, ())))
        caps.append(cap)
    return group, parents, children, caps


def _one_tree(inner: list[str], everyone: list[str], slots: dict[str, int], origin_slots: int,
              n_first: int | None = None, spare: list[list] | None = None, n_low: int = 0):
    """Breadth first from the origin: interior peers in the order given (fastest first), then the rest.
    Relays on trial (`inner` after the first `n_first`) take no place of the origin's while a relay has one.
    Once the places at the target rate are taken, the `spare` ones ([node, places], in order) are; the last
    `n_low` of `everyone` (not first in line) take spare places before any left at the rate: those left are
    the relays' not measured yet, and across namespaces honest relays measured idle, placed last, all hung
    under the two-faced keys that kept themselves unmeasured (bench/tree_attacks_netns.py, slow-loris)."""
    par: dict[str, str | None] = {}
    kids: dict[str | None, list[str]] = collections.defaultdict(list)
    free: collections.deque[list] = collections.deque([[None, origin_slots]])
    extra = collections.deque(spare or ())
    n_inner = len(inner)
    n_first = n_inner if n_first is None else n_first
    order = [*inner, *everyone]
    for j, pid in enumerate(order):
        if pid in par:
            continue
        while free and free[0][1] == 0:
            free.popleft()
        while extra and extra[0][1] == 0:
            extra.popleft()
        if extra and (not free or j >= len(order) - n_low):
            free.appendleft(extra.popleft())
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

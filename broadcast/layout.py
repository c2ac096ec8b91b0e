"""One version's layout of the k trees, and its repair in place while that version is in flight.

Laying every tree out afresh when one peer comes or goes shifts most peers under new parents mid-version,
parents that lack the pieces they are then asked for: their requests are held, answered 503 and reported
as stalls, and the demotions those bring re-lay the trees out again (640 stall reports in one version of
the 1000-peer simulation, docs/tree-simulation.md). So the tracker lays the trees out when nothing is in
flight and, while a version is, only repairs: a departed or demoted relay's children move to the
shallowest free place (never below a fresh key if they have standing, never into their own subtree), and a
newcomer takes a free place as a leaf in every tree (the origin's, when none is free). The next version
gets a fresh layout.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

Parents = dict[str, str | None]  # peer -> its parent in one tree (None: the origin)
Children = dict[str | None, list[str]]  # node (None: the origin) -> its children in one tree


class Layout:
    def __init__(self, parents: list[Parents], children: list[Children], caps: list[dict[str | None, int]]):
        self.parents = parents
        self.children = [collections.defaultdict(list, kids) for kids in children]
        self.caps = caps  # per tree: how many children a node may have (the origin's under None)
        self.depth: list[dict[str | None, int]] = [{None: 0} for _ in self.children]
        for t in range(len(self.children)):
            self._set_depths(t, None)

    def topology(self) -> tuple[list[Parents], list[Children]]:
        """The live structures, not copies (every heartbeat reads them): callers must not change them."""
        return self.parents, self.children

    def add(self, pid: str, ranked: Callable[[str | None], bool]) -> None:
        """A newcomer: a leaf in every tree, in the shallowest free place it may take."""
        for t in range(len(self.parents)):
            self.caps[t][pid] = 0
            self._adopt(t, pid, ranked)

    def remove(self, pid: str, ranked: Callable[[str | None], bool]) -> None:
        for t in range(len(self.parents)):
            parent = self.parents[t].pop(pid, None)
            if parent in self.children[t] and pid in self.children[t][parent]:
                self.children[t][parent].remove(pid)
            self.caps[t].pop(pid, None)
            self.depth[t].pop(pid, None)
            self._rehome(t, self.children[t].pop(pid, []), ranked)

    def make_leaf(self, pid: str, ranked: Callable[[str | None], bool]) -> None:
        """A relay that may no longer be interior (demoted, unreachable) keeps its places, loses its children."""
        for t in range(len(self.parents)):
            self.caps[t][pid] = 0
            self._rehome(t, self.children[t].pop(pid, []), ranked)

    def _rehome(self, t: int, orphans: list[str], ranked: Callable[[str | None], bool]) -> None:
        # Those with children of their own first: they take the shallowest places, their subtrees with them.
        # None goes under another of the same parent's orphans: each one moved brings its own free places a
        # level down, and the next took them, a chain of siblings. Simulated (N = 1000, 10% churn), one
        # departed relay's five relay children were so chained, 8 hops to the last peers (that delta 2.85x
        # its bound); rehomed beside each other, the delta over 20 seeds went from 1.47x to 1.40x, its worst
        # seed from 2.15x to 1.90x (docs/tree-simulation.md).
        siblings = set(orphans)
        for o in sorted(orphans, key=lambda o: -len(self.children[t].get(o, ()))):
            self.parents[t].pop(o, None)
            self._adopt(t, o, ranked, avoid=siblings)

    def _adopt(self, t: int, pid: str, ranked: Callable[[str | None], bool],
               avoid: set[str] | frozenset[str] = frozenset()) -> None:
        """Hang pid under the shallowest node with a free place (never one in `avoid`). When none has one,
        under the node with the most places per child it would then have: the origin feeds the top of every
        tree, and taking all the overflow (orphans, newcomers) starved those (docs/tree-simulation.md)."""
        par, kids, depth = self.parents[t], self.children[t], self.depth[t]
        needs_standing = ranked(pid)
        free: list[tuple[int, str | None]] = []
        full: list[tuple[float, int, str | None]] = []
        for node, cap in self.caps[t].items():
            if cap <= 0 or node == pid or node in avoid or (node is not None and node not in par):
                continue
            if needs_standing and node is not None and not ranked(node):
                continue  # no fresh key between the origin and a peer with standing
            n, d = len(kids.get(node, ())), depth.get(node, 1 << 20)
            if n < cap:
                free.append((d, node))
            else:
                full.append((-cap / (n + 1), d, node))
        free.sort(key=lambda x: x[0])
        full.sort(key=lambda x: x[:2])
        best = next((c[-1] for c in [*free, *full] if not self._below(t, c[-1], pid)), None)
        par[pid] = best  # None: the origin
        kids[best].append(pid)
        depth[pid] = depth.get(best, 0) + 1
        # Its subtree moves with it: stale depths there made a deep free place look shallow to the next
        # orphans and newcomers.
        self._set_depths(t, pid)

    def _set_depths(self, t: int, top: str | None) -> None:
        """The depths below `top` (None: the origin), from its own."""
        kids, depth = self.children[t], self.depth[t]
        queue = collections.deque([top])
        while queue:
            node = queue.popleft()
            for c in kids.get(node, ()):
                depth[c] = depth[node] + 1
                queue.append(c)

    def _below(self, t: int, node: str | None, pid: str) -> bool:
        """Is `node` in `pid`'s subtree (so that hanging pid under it would make a cycle)?"""
        par = self.parents[t]
        for _ in range(len(par) + 1):
            if node is None:
                return False
            if node == pid:
                return True
            node = par.get(node)
        return True


def join_order_layout(peers: list[tuple[str, int | None, int]], trees: int, fanout: int) -> Layout:
    """The layout before any uplink is measured: per tree, its group's relays in the order given as an f-ary
    heap, those placed above the rest (tier 2) on top, then the others' own heap, tier 1 before 0.
    `peers`: (peer_id, group if it may be interior, tier: forest.Forest.tier), in the forest's order
    (forest.Forest._order: a keyed shuffle of the join order)."""
    parents: list[Parents] = []
    children: list[Children] = []
    caps: list[dict[str | None, int]] = []
    ranked = {pid for pid, _, tier in peers if tier == 2}
    on_trial = {pid for pid, _, tier in peers if tier == 1}
    for t in range(trees):
        par: Parents = {}
        kids: Children = collections.defaultdict(list)

        def attach(pid: str, parent: str | None, par=par, kids=kids) -> None:
            par[pid] = parent
            kids[parent].append(pid)

        def free(nodes: list[str], kids=kids) -> list[str]:  # places, shallowest first
            return [pid for pid in nodes for _ in range(fanout - len(kids[pid]))]

        def fewest(nodes: list[str], kids=kids) -> str | None:  # where a peer goes once no place is free
            return min(nodes, key=lambda q: len(kids[q]), default=None)

        interior = [pid for pid, group, _ in peers if group == t]
        top = [pid for pid in interior if pid in ranked]
        trial = sorted((pid for pid in interior if pid not in ranked), key=lambda q: q not in on_trial)
        for j, pid in enumerate(top):
            attach(pid, None if j == 0 else top[(j - 1) // fanout])
        top_slots = free(top)
        k = 0
        for pid, _, tier in peers:  # leaves with standing first, in the places under peers with standing
            if pid not in par and tier == 2:
                # None full: the one with the fewest children takes it, not the origin (a second child of
                # the origin's in a tree halves what the tree's top receives; bench/tree_attacks_sim.py).
                spare = top_slots[k] if k < len(top_slots) else fewest(top)
                attach(pid, spare)
                k += 1
        # Fresh relays: a heap of their own, hung from the places left (the origin's when none are).
        left = top_slots[k:]
        roots: list[str | None] = list(left[: len(trial)]) or [None]
        for j, pid in enumerate(trial):
            attach(pid, roots[j] if j < len(roots) else trial[(j - len(roots)) // fanout])
        places = iter([*left[len(trial):], *free(trial)])
        for pid, _, _ in sorted(peers, key=lambda p: -p[2]):  # on trial before fresh: the shallower places
            if pid not in par:
                # None free: the relay with the fewest children takes it, as above, the origin only where there
                # is none. k = f trees of f-ary heaps have room for N relays and no more: among strangers, a
                # third of them leaves (unreachable) made the origin the parent of 32 peers in every tree,
                # and the first version 15-18x as long (bench/tree_attacks_sim.py --strangers --leaves 0.3).
                attach(pid, next(places, None) or fewest(trial or top))
        parents.append(par)
        children.append(dict(kids))
        cap: dict[str | None, int] = {pid: 0 for pid, _, _ in peers}
        cap.update({pid: fanout for pid in interior})
        cap[None] = max(1, len(kids[None]))
        caps.append(cap)
    return Layout(parents, children, caps)

"""Who is first in each uplink's line (uplink_share.py paces the rest): the tracker's answer for the origin,
per request, and for each relay, the addresses below it that wait (TreeSources.low). Sans-I/O: it reads
the tracker's members, standing and layout, and decides nothing else.

While any member vouches (keys the trainer trusts, or that earned standing from them), those who do are
first. Where nobody vouches (strangers alone), every member but the relays their children measured as
sending next to nothing (upload_meter.IDLE_RATE): one piece shown to the origin buys no priority, and a key
that takes every version and gives none waits behind those who give (a third of the swarm so made every
honest version 1.4-1.9x as long, bench/tree_attacks_sim.py --strangers). And among strangers the origin
sends first to the two levels it feeds in the piece's tree, its children and theirs: the origin's uplink is
the one every tree starts from, and where the keys above them were silent, peers deep in the trees went
around to the origin by the dozen; served alike, they kept the tops of the trees waiting (the children of
a silent root had their tree's pieces at 97 s, 31 s so; bench/tree_attacks_sim.py --strangers --n 100).
"""

from __future__ import annotations

from collections.abc import Callable

from .forest import Forest
from .peer_rec import PeerRec

MAX_LOW = 256  # addresses in TreeSources.low


class UplinkLine:
    def __init__(self, peers: dict[str, PeerRec], forest: Forest, any_vouching: Callable[[], bool],
                 vouches: Callable[[PeerRec], bool]):
        """The tracker's members, its trees, and standing's answers: does any member vouch, does this one."""
        self.peers, self.forest = peers, forest
        self.any_vouching, self.vouches = any_vouching, vouches

    def first(self, peer_id: str, tree: int | None = None) -> bool:
        """Is an uplink this member's first? `tree`: the tree of the piece it asks the origin for (None: a
        relay's uplink, or not a piece)."""
        rec = self.peers.get(peer_id)
        if rec is None:
            return False
        if self.any_vouching():
            return self.vouches(rec)
        if self.forest.uploads.idle(rec.url or ""):
            return False
        if tree is None:
            return True
        parents = self.forest.topology()[0][tree % self.forest.k]
        above = parents.get(peer_id)
        return above is None or parents.get(above) is None

    def low_below(self, rec: PeerRec) -> list[str]:
        """The addresses of the members below it (in every tree: those who may ask it, their parents' and
        its own children) that are not first in line: it sends to them from what the others leave. An
        address one of those others has too is left out: sharing an address with a key that has standing
        costs that key nothing."""
        if not rec.interior_capable:
            return []
        _, children = self.forest.topology()
        low, first = set(), set()
        for tree in children:
            todo = list(tree.get(rec.peer_id, ()))
            while todo and len(low) + len(first) < 4 * MAX_LOW:
                pid = todo.pop()
                todo.extend(tree.get(pid, ()))
                if (below := self.peers.get(pid)) is not None and below.addr:
                    (first if self.first(pid) else low).add(below.addr)
        return sorted(low - first)[:MAX_LOW]

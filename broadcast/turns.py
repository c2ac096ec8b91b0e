"""A child's requests to one source take turns, per tree (sans-I/O: the queue, not the waiting).

A child keeps `window` requests in flight per tree so that its parent's pipe stays full across piece
boundaries; sent at once, they split the child's share of the uplink, and each piece took `window` times
as long to reach the child, at every hop. Simulated at 1000 peers (10% churn), on average over five draws,
before the origin's uplink probes: a 13.5 MB delta 1.76x the fluid bound with turns, 2.23x without; a full
version 1.21x and 1.35x (docs/tree-simulation.md). serving.Turns waits on this queue over HTTP, the
simulator (bench/simlib) on simulated transfers.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable


def turn_key(child: str, index: int, trees: int) -> tuple[str, int]:
    """Whose turn a request for piece `index` waits for: the child's (its address and word) on that tree."""
    return child[:128], index % max(1, trees)


class TurnQueue:
    def __init__(self) -> None:
        self._q: dict[Hashable, collections.deque] = {}  # only keys with requests in progress: bounded

    def arrive(self, key: Hashable, item: object) -> bool:
        """`item` asks for a turn; True when it is its turn now (nobody ahead)."""
        q = self._q.setdefault(key, collections.deque())
        q.append(item)
        return len(q) == 1

    def leave(self, key: Hashable, item: object) -> object | None:
        """`item` is done (sent, failed, or given up waiting); -> the item whose turn it now is, if the turn
        passed on."""
        q = self._q.get(key)
        if not q or item not in q:
            return None
        had_turn = q[0] is item
        q.remove(item)
        if not q:
            del self._q[key]
            return None
        return q[0] if had_turn else None

    def waiting(self, key: Hashable) -> int:
        return len(self._q.get(key, ()))

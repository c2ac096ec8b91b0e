"""An uplink goes to members with standing first (sans-I/O: bytes and a clock in, waits out).

Identities are free: a fresh key may take no more than a small share of anything. In a new swarm the keys
without standing hang from the origin as a heap of their own (layout.join_order_layout), and their
requests split the origin's uplink with the top of every tree: ten fresh keys that forwarded nothing made
the first version 3.5x slower for everyone else; later, as leaves, they took an equal share of every
relay's uplink (bench/tree_attacks_sim.py). So while a source is sending to members first in line
(tracker.Tracker.first_in_line: those who vouch, while any member does), everything it sends to the others
together is paced to LOW_SHARE of what it sends, never below MIN_LOW_RATE; when nobody first in line is
being sent anything, the others have the whole uplink. An honest stranger's version comes a little later,
never not. The origin tells first from the request's member pass; a relay, from the addresses the tracker
names to it (TreeSources.low: the members below it that are not first). Their HTTP routes feed this every
slice they send; the simulator splits its simulated uplinks by the same share (bench/simlib/engine.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

LOW_SHARE = 0.1  # of the origin's uplink, the members without standing together, while others are served
MIN_LOW_RATE = 64 << 10  # bytes/s they always get
WINDOW_S = 0.5  # how far back "what it sends to members with standing" looks


class UplinkShare:
    def __init__(self, clock: Callable[[], float], share: float = LOW_SHARE, window: float = WINDOW_S,
                 min_rate: float = MIN_LOW_RATE):
        self.clock, self.share, self.window, self.min_rate = clock, share, window, min_rate
        self._first: collections.deque[tuple[float, int]] = collections.deque()  # (at, bytes) to those first
        self._first_bytes = 0
        self._next = 0.0  # when the next slice to the rest may go

    def first_sent(self, n: int) -> None:
        """`n` bytes went out to a member first in line."""
        self.sent(n, True)

    def low_sent(self, n: int) -> float:
        """`n` bytes went out to another; -> the seconds its sender waits before the next slice."""
        return self.sent(n, False)

    def sent(self, n: int, first: bool) -> float:
        now = self.clock()
        while self._first and self._first[0][0] < now - self.window:
            self._first_bytes -= self._first.popleft()[1]
        if first:
            self._first.append((now, n))
            self._first_bytes += n
            return 0.0
        if not self._first:
            self._next = now
            return 0.0
        rate = max(self.min_rate, self._first_bytes / self.window * self.share / (1 - self.share))
        self._next = max(self._next, now) + n / rate
        return self._next - now

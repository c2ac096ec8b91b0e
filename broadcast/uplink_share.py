"""An uplink goes to members with standing first (sans-I/O: bytes and a clock in, waits out).

Identities are free: a fresh key may take no more than a small share of anything. In a new swarm the keys
without standing hang from the origin as a heap of their own (layout.join_order_layout), and their
requests split the origin's uplink with the top of every tree: ten fresh keys that forwarded nothing made
the first version 3.5x slower for everyone else; later, as leaves, they took an equal share of every
relay's uplink (bench/tree_attacks_sim.py). So while a source is sending to members first in line
(uplink_line.UplinkLine.first: those who vouch, while any member does; among strangers, all but the relays
measured as sending next to nothing), everything it sends to the others
together is paced to one such member's share of what it sends, at least LOW_SHARE, never below
MIN_LOW_RATE (`low_share`); when nobody first in line is being sent anything, the others have the whole
uplink. An honest stranger's version comes a little later,
never not. The origin tells first from the request's member pass; a relay, from the addresses the tracker
names to it (TreeSources.low: the members below it that are not first). Their HTTP routes feed this every
slice they send; the simulator splits its simulated uplinks by the same share (bench/simlib/engine.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

LOW_SHARE = 0.1  # of an uplink, the members without standing together at least, while others are served
MIN_LOW_RATE = 64 << 10  # bytes/s they always get
WINDOW_S = 0.5  # how far back "what it sends to members first in line" looks


def low_share(first_members: int, share: float = LOW_SHARE) -> float:
    """The part of an uplink the members not first in line get together, while `first_members` others are
    being sent to: as much as one of those, and never less than `share`. Identities are free, so all keys
    without standing weigh as one member, whatever their number; and a stranger on probation beside one
    established node still gets half (at a tenth it fell behind a run that published every second and
    never loaded a version: tests/netlab/test_strangers_netns.py)."""
    return max(share, 1.0 / (first_members + 1))


class UplinkShare:
    """Bytes and a clock in, waits out: a sender reports each slice; one to the rest learns how long to wait.
    Only while an answer to a member first in line is being sent are the rest paced (after its last slice
    the window's figure would still throttle them: a stranger on probation paced so fell 8 versions behind
    the established node beside it and was never paired with it)."""

    def __init__(self, clock: Callable[[], float], share: float = LOW_SHARE, window: float = WINDOW_S,
                 min_rate: float = MIN_LOW_RATE):
        self.clock, self.share, self.window, self.min_rate = clock, share, window, min_rate
        self._first: collections.deque[tuple[float, int]] = collections.deque()  # (at, bytes) to those first
        self._first_bytes = 0
        self.sending: collections.Counter[str] = collections.Counter()  # answers in progress, by member
        self._next = 0.0  # when the next slice to the rest may go

    def first_sent(self, n: int, who: str, started: bool) -> None:
        """`n` bytes went out to `who`, a member first in line; `started`: its answer's first slice (the
        sender calls first_done when that answer ends)."""
        self._expire(now := self.clock())
        if started:
            self.sending[who] += 1
        self._first.append((now, n))
        self._first_bytes += n

    def first_done(self, who: str) -> None:
        self.sending[who] -= 1
        if self.sending[who] <= 0:
            del self.sending[who]

    def low_sent(self, n: int) -> float:
        """`n` bytes went out to another; -> the seconds its sender waits before the next slice."""
        self._expire(now := self.clock())
        if not self.sending or not self._first:
            self._next = now
            return 0.0
        part = low_share(len(self.sending), self.share)
        rate = max(self.min_rate, self._first_bytes / self.window * part / (1 - part))
        self._next = max(self._next, now) + n / rate
        return self._next - now

    def _expire(self, now: float) -> None:
        while self._first and self._first[0][0] < now - self.window:
            self._first_bytes -= self._first.popleft()[1]


class FirstAnswer:
    """One answer to a member first in line, as serving.py sends it: its slices go to the share; `done`
    when the answer ends (sent, cut or given up)."""

    def __init__(self, share: UplinkShare, who: str, also: Callable[[int], None] | None = None):
        self.share, self.who, self.also, self.started = share, who, also, False

    def __call__(self, n: int) -> None:
        self.share.first_sent(n, self.who, not self.started)
        self.started = True
        if self.also:
            self.also(n)

    def done(self) -> None:
        if self.started:
            self.share.first_done(self.who)
            self.started = False

"""Discrete-event core: a clock, an event heap, and hosts whose links are shared by piece transfers.

Sharing rule (stated in docs/tree-simulation.md): every transfer into a host is capped at an equal share of
that host's downlink; each uplink is then shared max-min fairly among its transfers under those caps (a
water-fill). A transfer's rate changes only when a transfer starts or ends on its sender's uplink or its
receiver's downlink, so each event re-plans a handful of uplinks, not the whole network.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from broadcast.uplink_share import low_share


class Sim:
    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0
        self.stopped = False
        self._heap: list = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (self.now + dt, next(self._seq), fn, args))

    def run(self, until: float) -> None:
        heap, pop = self._heap, heapq.heappop
        while heap and not self.stopped:
            t, _, fn, args = pop(heap)
            if t > until:
                break
            self.now = t
            self.events += 1
            fn(*args)


class Host:
    __slots__ = ("name", "up", "down", "lat", "outs", "ins", "alive", "gen", "low_share")

    def __init__(self, name: str, up: float, down: float, lat: float):
        self.name, self.up, self.down, self.lat = name, up, down, lat
        self.low_share = 0.0  # >0: transfers marked low get at least this share of `up` while others run
        # Dicts, not sets: iterated in the order transfers began, not by memory address (runs repeat).
        self.outs: dict[Xfer, None] = {}
        self.ins: dict[Xfer, None] = {}
        self.alive = True
        self.gen = 0  # one pending "next transfer done" event per uplink; older ones are stale


class Xfer:
    __slots__ = ("src", "dst", "size", "done", "rate", "t", "on_end", "live", "low")

    def __init__(self, src: Host, dst: Host, size: float, on_end: Callable[[Xfer, bool], None], low: bool = False):
        self.src, self.dst, self.size, self.on_end, self.low = src, dst, size, on_end, low
        self.done = 0.0
        self.rate = 0.0
        self.t = 0.0
        self.live = True


class Net:
    EPS = 1e-9

    def __init__(self, sim: Sim):
        self.sim = sim
        self.bytes_moved = 0.0

    def start(self, src: Host, dst: Host, size: float, on_end: Callable[[Xfer, bool], None],
              low: bool = False) -> Xfer:
        x = Xfer(src, dst, size, on_end, low)
        x.t = self.sim.now
        old_cap = dst.down / len(dst.ins) if dst.ins else 0.0
        src.outs[x] = None
        dst.ins[x] = None
        self._replan(src, dst, old_cap, shrink=True)
        return x

    def cancel(self, x: Xfer) -> None:
        """Stop a transfer (an end went away); its on_end is called with ok=False."""
        if x.live:
            self._end(x, ok=False)

    def _due(self, h: Host, gen: int) -> None:
        if gen != h.gen:
            return
        now = self.sim.now
        for x in [x for x in h.outs if x.size - x.done - x.rate * (now - x.t) <= 1e-6 * x.size]:
            if x.live:
                self._end(x, ok=True)
        if h.outs and gen == h.gen:  # nothing ended (rounding): plan again
            self._fill(h)

    def _end(self, x: Xfer, ok: bool) -> None:
        x.live = False
        src, dst = x.src, x.dst
        if ok:
            self.bytes_moved += x.size
        old_cap = dst.down / len(dst.ins)
        src.outs.pop(x, None)
        dst.ins.pop(x, None)
        self._replan(src, dst, old_cap, shrink=False)
        x.on_end(x, ok)

    def _replan(self, src: Host, dst: Host, old_cap: float, shrink: bool) -> None:
        """Re-fill `src`'s uplink, and the uplinks of dst's other senders whose cap now binds or unbinds."""
        todo = [src]
        if dst.ins:
            new_cap = dst.down / len(dst.ins)
            for y in dst.ins:
                h = y.src
                if h is src or h in todo:
                    continue
                # Shrinking cap: matters if y runs above it. Growing: matters if y was held at the old cap.
                if (shrink and y.rate > new_cap + self.EPS) or (not shrink and y.rate >= old_cap - self.EPS):
                    todo.append(h)
        for h in todo:
            self._fill(h)

    def _fill(self, h: Host) -> None:
        """Water-fill h's uplink over its transfers, then schedule the one that ends first. A host with a
        low share gives its low transfers together what broadcast/uplink_share.low_share says while others
        run: one receiver's share, at least `low_share`."""
        h.gen += 1
        xs = h.outs
        if not xs:
            return
        now = self.sim.now
        low = [x for x in xs if x.low] if h.low_share else []
        if low and len(low) < len(xs):
            high = [x for x in xs if not x.low]
            part = low_share(len({x.dst for x in high}), h.low_share)
            plan = _water(h.up * (1 - part), high) + _water(h.up * part, low)
        else:
            plan = _water(h.up, xs)
        first = float("inf")
        for r, x in plan:
            x.done += x.rate * (now - x.t)
            x.t = now
            x.rate = r
            end = (x.size - x.done) / r
            if end < first:
                first = end
        self.sim.at(now + max(first, 0.0), self._due, h, h.gen)


def _water(up: float, xs) -> list[tuple[float, Xfer]]:
    """`up` shared max-min fairly by the transfers `xs`, each capped by its receiver's downlink share."""
    n = len(xs)
    share = up / n
    caps = [(x.dst.down / len(x.dst.ins), x) for x in xs]
    if min(caps, key=_first)[0] >= share:  # the usual case: nobody is held back by its downlink
        return [(share, x) for _, x in caps]
    plan, left = [], up
    for cap, x in sorted(caps, key=_first):
        r = left / n
        if cap < r:
            r = cap
        plan.append((r, x))
        left -= r
        n -= 1
    return plan


def _first(pair: tuple) -> float:
    return pair[0]

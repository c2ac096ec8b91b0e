"""Star and SHARDCAST's shape as fluid models: no pieces, no latency, perfect sharing. Both flatter the design
they model (a real one can only be slower), so the tree is compared against their best case."""

from __future__ import annotations

import math


def serve(up: float, size: float, clients: list[tuple[float, float, float]]) -> list[float]:
    """One uplink shared max-min fairly by clients (arrive, leave, downlink cap), each wanting `size` bytes.
    Returns each client's finish time (inf if it left first)."""
    n = len(clients)
    got = [0.0] * n
    fin = [math.inf] * n
    t = 0.0
    while True:
        active = [i for i in range(n) if clients[i][0] <= t < clients[i][1] and fin[i] == math.inf]
        later = [c[0] for c in clients if c[0] > t] + [c[1] for c in clients if t < c[1] < math.inf]
        if not active and not later:
            return fin
        rate = {}
        left, k = up, len(active)
        for i in sorted(active, key=lambda i: clients[i][2]):
            r = min(clients[i][2], left / k)
            rate[i] = r
            left -= r
            k -= 1
        dt = min([(size - got[i]) / rate[i] for i in active] + [x - t for x in later] or [math.inf])
        t += dt
        for i in active:
            got[i] += rate[i] * dt
            if got[i] >= size * (1 - 1e-12):
                fin[i] = t


def star(size: float, u_origin: float, clients: list[tuple[float, float, float]]) -> list[float]:
    return serve(u_origin, size, clients)


def shardcast(size: float, u_origin: float, relay_up: float, relay_down: float,
              clients: list[tuple[float, float, float]]) -> tuple[list[float], int]:
    """Origin -> ceil(sqrt(N)) relays -> clients (clients split evenly, never upload). A client finishes no
    sooner than its relay has the whole version (pipelining at best) nor than its share of the relay allows."""
    m = math.ceil(math.sqrt(len(clients)))
    relay_done = serve(u_origin, size, [(0.0, math.inf, relay_down)] * m)
    fin = [math.inf] * len(clients)
    for j in range(m):
        mine = list(range(j, len(clients), m))
        got = serve(relay_up, size, [clients[i] for i in mine])
        for i, f in zip(mine, got, strict=True):
            fin[i] = max(f, relay_done[j]) if f < math.inf else f
    return fin, m

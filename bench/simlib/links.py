"""Who the peers are: link distributions (stated exactly, seeded) and the fluid lower bound on T."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Mbit = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass
class Link:
    up: float  # bytes/s
    down: float  # bytes/s
    lat: float  # one-way seconds from this host to the core; a path a->b takes lat_a + lat_b


def _lu(rng: random.Random, lo: float, hi: float) -> float:
    """Log-uniform on [lo, hi]: as many hosts per octave, so many slow links and few fast ones."""
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw(dist: str, rng: random.Random) -> Link:
    """One peer's link. Rates in Mbit/s, latencies in ms (converted on return)."""
    if dist == "home-mix":
        u = rng.random()
        if u < 0.70:  # home: cable/DSL/FTTC, asymmetric
            up, down, lat = _lu(rng, 5, 50), _lu(rng, 100, 1000), rng.uniform(10, 40)
        elif u < 0.95:  # office / fibre to the home
            up = _lu(rng, 50, 500)
            down, lat = max(up, _lu(rng, 100, 1000)), rng.uniform(5, 25)
        else:  # a rented server
            up, down, lat = 1000.0, 1000.0, rng.uniform(1, 5)
    elif dist == "loguniform":  # the example taken literally: up and down independent
        up, down, lat = _lu(rng, 5, 1000), _lu(rng, 5, 1000), rng.uniform(5, 50)
    elif dist == "uniform":  # every host alike (for checking against the real bench)
        up, down, lat = 1.0, math.inf, 0.0
    else:
        raise ValueError(f"unknown distribution {dist!r}")
    return Link(up * Mbit, down * Mbit, lat / 1000)


DISTRIBUTIONS = {
    "home-mix": "70% home (up LU[5,50], down LU[100,1000] Mbit/s, 10-40 ms), 25% office/fibre "
                "(up LU[50,500], down max(up, LU[100,1000]), 5-25 ms), 5% servers (1000/1000, 1-5 ms); "
                "LU = log-uniform; latency is one-way to the core, a path adds both ends",
    "loguniform": "up and down independent LU[5,1000] Mbit/s, latency 5-50 ms",
}


def fluid_bound(size: float, u_origin: float, links: list[Link], arrivals: list[tuple[float, Link]] = ()) -> float:
    """max(S/u_origin, S/d_min, N*S/(u_origin + sum of uplinks)) over the peers present at the end; with
    churn also max(a + S/d) over peers arriving at time a (none can finish before its own downlink allows)."""
    d_min = min(lk.down for lk in links)
    n = len(links)
    b = max(size / u_origin, size / d_min, n * size / (u_origin + sum(lk.up for lk in links)))
    for a, lk in arrivals:
        b = max(b, a + size / lk.down)
    return b

"""Token buckets by key (sans-I/O: the caller says what time it is): how joins, reports, heartbeats and the
doctor's tests are rate-limited per source address or key."""

from __future__ import annotations


class KeyedBuckets:
    """Token buckets by key (a source address, a public key): `burst` at once, then `rate` per second.
    Bounded: the least recently used keys are forgotten past `max_keys` (a forgotten key starts full)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._b: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str, now: float) -> float:
        """0.0 when allowed (a token is spent), else the seconds until one is due."""
        tokens, at = self._b.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            self._b[key] = (tokens - 1.0, now)
            wait = 0.0
        else:
            self._b[key] = (tokens, now)
            wait = (1.0 - tokens) / self.rate if self.rate > 0 else float("inf")
        while len(self._b) > self.max_keys:
            del self._b[next(iter(self._b))]
        return wait

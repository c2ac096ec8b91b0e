"""An upload rate limiter: one per host, shared by every response it sends (emulates one uplink)."""

from __future__ import annotations

import asyncio
import time


class RateLimiter:
    """Paces bytes to `rate` B/s. Callers queue in arrival order, so concurrent uploads share fairly."""

    def __init__(self, rate: float | None, burst: float = 0.02):
        self.rate = rate
        self._next = time.monotonic()
        self._burst = burst  # seconds of credit allowed to accumulate, so idle time isn't banked

    async def acquire(self, n: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        # Idle time is banked up to `burst`, but never more than this request's own time: bytes leave at
        # the rate, not in bursts (a child measures our uplink by their arrival).
        start = max(self._next, now - min(self._burst, n / self.rate))
        self._next = start + n / self.rate
        delay = self._next - now
        if delay > 0:
            await asyncio.sleep(delay)


class KeyedBuckets:
    """Token buckets by key (a source address, a public key): `burst` at once, then `rate` per second.
    Bounded: the least recently used keys are forgotten past `max_keys` (a forgotten key starts full)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._b: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str, now: float | None = None) -> float:
        """0.0 when allowed (a token is spent), else the seconds until one is due."""
        now = time.monotonic() if now is None else now
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

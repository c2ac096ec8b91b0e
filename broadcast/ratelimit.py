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

"""What a peer received from each source, for the tracker's placement (broadcast/placement.py).

Per source URL: bytes of verified pieces, and the seconds during which at least one response from that
source was streaming (concurrent requests to one source count their overlap once), from a response's
first bytes to its last (a relay answers at once and may hold the request until the piece reaches it: that
wait says nothing of its uplink). A report covers busy time only
up to the end of the last stream that finished, so a piece still arriving never inflates a rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .messages import Received


class _Source:
    __slots__ = ("bytes", "busy", "open", "since", "at_last_end", "reported")

    def __init__(self) -> None:
        self.bytes = 0  # verified, since the last report
        self.busy = 0.0  # cumulative seconds with a stream open, closed spans only
        self.open = 0
        self.since = 0.0
        self.at_last_end = 0.0  # cumulative busy seconds when a stream last ended
        self.reported = 0.0  # cumulative busy seconds already reported


class ReceiveMeter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._m: dict[str, _Source] = {}

    def begin(self, url: str) -> None:
        m = self._m.get(url)
        if m is None:
            m = self._m[url] = _Source()
        if m.open == 0:
            m.since = self._clock()
        m.open += 1

    def end(self, url: str) -> None:
        m, now = self._m[url], self._clock()
        m.open -= 1
        if m.open == 0:
            m.busy += now - m.since
            m.at_last_end = m.busy
        else:
            m.at_last_end = m.busy + now - m.since

    def credit(self, url: str, verified_bytes: int) -> None:
        """Count a piece once its hash matched (after end())."""
        m = self._m.get(url)
        if m is not None:
            m.bytes += verified_bytes

    def take(self) -> dict[str, Received]:
        """What came from each source since the last call."""
        out = {}
        for url, m in list(self._m.items()):
            if m.bytes > 0 and len(out) < 64:
                out[url] = Received(m.bytes, round(min(m.at_last_end - m.reported, 3600.0), 4))
                m.bytes, m.reported = 0, m.at_last_end
            elif m.open == 0 and m.bytes == 0:
                del self._m[url]
        return out

"""What a peer received from each source, for the tracker's placement (broadcast/placement.py).

Per source URL: bytes of verified pieces, and the seconds during which that source was sending to us
(responses that overlap count their overlap once). A response is timed when it ends, from when the source
began sending it to its last byte: a relay answers at once and may hold the request until the piece
reaches it, and that wait says nothing of its uplink. So a report covers finished responses only, and a
piece still arriving never inflates a rate.
"""

from __future__ import annotations

from .messages import Received


class _Source:
    __slots__ = ("bytes", "busy", "covered", "reported")

    def __init__(self) -> None:
        self.bytes = 0  # verified, since the last report
        self.busy = 0.0  # cumulative seconds sending to us
        self.covered = float("-inf")  # the latest end of a span counted
        self.reported = 0.0  # cumulative busy seconds already reported


class ReceiveMeter:
    def __init__(self) -> None:
        self._m: dict[str, _Source] = {}
        self._silent: dict[str, float] = {}  # per source: seconds it answered us and then sent nothing

    def span(self, url: str, start: float, end: float) -> None:
        """The source sent us one response over [start, end] (times on one clock)."""
        m = self._m.get(url)
        if m is None:
            m = self._m[url] = _Source()
        if end > m.covered:  # responses end about in order: what an earlier one covered is not counted again
            m.busy += end - max(start, m.covered)
            m.covered = end

    def credit(self, url: str, verified_bytes: int) -> None:
        """Count a piece once its hash matched (after its span)."""
        m = self._m.get(url)
        if m is not None:
            m.bytes += verified_bytes

    def silent(self, url: str, seconds: float) -> None:
        """The source answered a request and then sent nothing for `seconds` (we went around it): reported
        as zero bytes over that time, unless it also delivered something since the last report. Without
        it a key that answers everyone and sends no one anything was never measured at all, and each new
        layout placed it inside the trees again as a relay not yet measured (issue 29)."""
        if url in self._silent or len(self._silent) < 64:
            self._silent[url] = self._silent.get(url, 0.0) + max(0.0, seconds)

    def take(self) -> dict[str, Received]:
        """What came from each source since the last call."""
        out = {}
        for url, m in list(self._m.items()):
            if m.bytes > 0 and len(out) < 64:
                out[url] = Received(m.bytes, round(min(m.busy - m.reported, 3600.0), 4))
                m.bytes, m.reported = 0, m.busy
            elif m.bytes == 0 and m.busy == m.reported:
                del self._m[url]
        for url, seconds in self._silent.items():
            if url not in out and len(out) < 64 and seconds > 0:
                out[url] = Received(0, round(min(seconds, 3600.0), 4))
        self._silent.clear()
        return out


def sending_started(answered: float, first_at: float, last_at: float, first_bytes: int,
                    total: int) -> float | None:
    """When the source began sending a response whose first `first_bytes` of `total` arrived together at
    `first_at` and the last at `last_at`: back from the first arrival by the time the first bytes took at
    the rate of the rest, never before the answer. None when it all came in one read: no rate to go by
    (counting from the answer would count a hold as sending; a self-paced piece on loopback comes so)."""
    if total <= first_bytes or last_at <= first_at:
        return None
    return max(answered, first_at - (last_at - first_at) * first_bytes / (total - first_bytes))

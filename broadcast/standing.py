"""Standing in the relay tree, in one place: whose reports count, who ranks above fresh keys, and what a
report the origin could not confirm costs its maker (sans-I/O: the time comes from the clock given).

Identities are free, so a fresh key is trusted with nothing. A key has standing when the trainer calls it
established (`trusted`), or when it has shown it uploads (`proven`: the origin fetched a piece back from
it intact, or receivers confirm receiving `prove_bytes` from it), and it has not made many reports the
origin could not confirm (`penalty`, forgiven one per minute). A demoted relay loses its proof.

Standing is *earned* (`earned`) only through receivers who have earned it themselves or whom the trainer
trusts: what they confirm receiving from a relay they were placed under. Only earned (or trusted) keys
vouch for others, as receivers and as independent reporters (verdicts.py): a key that showed the origin
one piece ranks above fresh keys but lifts no one, so a ring of new keys cannot lift itself (issue 29).
The tracker reacts to changes (a new layout); it decides none of this.
"""

from __future__ import annotations

from typing import Protocol

PENALTY_DECAY_S = 60.0  # one unconfirmed report forgiven per minute
MAX_KEYS = 10_000  # penalties remembered (the least recently penalized are forgotten)


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def time(self) -> float: ...


class ManualClock:
    """A clock that moves only when told (tests; the simulator moves it to its own time)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class Uploads(Protocol):
    """A member's upload record (tracker.PeerRec)."""

    served_bytes: int  # what it says it uploaded
    confirmed: dict[str, int]  # child key (with standing) -> bytes that child says it received from it


class Standing:
    def __init__(self, clock: Clock, penalty_limit: float = 5.0, prove_bytes: int = 1 << 16):
        self.clock, self.penalty_limit, self.prove_bytes = clock, penalty_limit, prove_bytes
        self.trusted: set[str] = set()  # keys the trainer calls established
        self.proven: set[str] = set()  # keys that have shown they upload
        self.earned: set[str] = set()  # of those, keys that receivers who vouch confirmed (a subset of proven)
        self.penalty: dict[str, tuple[float, float]] = {}  # key -> (unconfirmed-report points, at)

    def ranked(self, key: str) -> bool:
        """Placed above fresh keys: trusted, or shown it uploads (penalties aside)."""
        return key in self.trusted or key in self.proven

    def has(self, key: str) -> bool:
        """Its reports count, and what it says it received is evidence: ranked, and not many reports the
        origin could not confirm."""
        return self.ranked(key) and self.points(key) <= self.penalty_limit - 1

    def vouches(self, key: str) -> bool:
        """What it says of others counts as a receiver's confirmation and as an independent report: trusted,
        or earned from receivers who vouch themselves (never from the origin's one piece alone)."""
        return (key in self.trusted or key in self.earned) and self.has(key)

    def reports_ignored(self, key: str) -> bool:
        return self.points(key) > self.penalty_limit - 1

    def points(self, key: str) -> float:
        pts, at = self.penalty.get(key, (0.0, 0.0))
        return max(0.0, pts - (self.clock.monotonic() - at) / PENALTY_DECAY_S)

    def penalize(self, key: str) -> None:
        """A report the origin could not confirm: it costs the reporter, never the accused."""
        pts = self.points(key) + 1.0
        self.penalty.pop(key, None)  # re-inserted last: the bound forgets the keys quiet the longest
        self.penalty[key] = (pts, self.clock.monotonic())
        while len(self.penalty) > MAX_KEYS:
            del self.penalty[next(iter(self.penalty))]

    def refund(self, key: str) -> None:
        """A report that cost its maker was confirmed later (by an independent reporter): given back."""
        if key in self.penalty:
            pts, at = self.penalty[key]
            self.penalty[key] = (max(0.0, pts - 1.0), at)

    def trust(self, key: str, trusted: bool) -> bool:
        """The trainer calls `key` established (or no longer); True if that changed anything."""
        if (key in self.trusted) == trusted:
            return False
        (self.trusted.add if trusted else self.trusted.discard)(key)
        return True

    def prove(self, key: str, earned: bool = False) -> bool:
        """`key` has shown it uploads (`earned`: to receivers who vouch); True if it ranks higher now."""
        was = (key in self.proven, key in self.earned)
        self.proven.add(key)
        if earned:
            self.earned.add(key)
        return was != (key in self.proven, key in self.earned)

    def revoke(self, key: str) -> None:
        """Demoted: its proof no longer stands (it earns it again by uploading)."""
        self.proven.discard(key)
        self.earned.discard(key)

    def confirm(self, source: Uploads, child_key: str, received: int) -> bool:
        """A receiver who vouches (`vouches`) says it received `received` bytes from `source` in all; True
        once what both sides say reaches prove_bytes (the source's claim caps what receivers confirm)."""
        source.confirmed[child_key] = received
        if len(source.confirmed) > 256:
            del source.confirmed[next(iter(source.confirmed))]
        return uploaded(source) >= self.prove_bytes


def uploaded(rec: Uploads) -> int:
    """Bytes it uploaded by both accounts: its own claim, capped by what children with standing saw."""
    return min(rec.served_bytes, sum(rec.confirmed.values()))

"""Who may not be in the tree: banned memberships, keys and addresses (sans-I/O), and the refusals that need
no network (a banned key or address)."""

from __future__ import annotations

from .messages import Banned
from .standing import Clock

MAX_BANNED = 10_000  # bans remembered per kind (the oldest are forgotten)


class TrackerError(Exception):
    def __init__(self, status: int, msg: str, reason: str = "refused"):
        super().__init__(msg)
        self.status, self.reason = status, reason


class Bans:
    def __init__(self, clock: Clock):
        self.clock = clock
        self.by_peer: dict[str, Banned] = {}  # by peer_id (what a banned member's heartbeats are told)
        self.keys: dict[str, Banned] = {}
        self.urls: set[str] = set()  # served confirmed corrupt data from there (proven theirs)

    def refusal(self, key: str, url: str | None) -> TrackerError | None:
        if key in self.keys:
            return TrackerError(403, f"key {key[:16]}... is banned: {self.keys[key].reason}", "banned_key")
        if url is not None and url in self.urls:
            return TrackerError(403, f"{url} was removed for serving corrupt data", "banned_url")
        return None

    def member(self, peer_id: str, url: str | None, key: str, reason: str, reporter: str) -> None:
        b = Banned(peer_id, url, reason, reporter, self.clock.time(), key)
        self.by_peer[peer_id] = b
        if key:
            self.keys[key] = b
        if url:
            self.urls.add(url)
        for d in (self.by_peer, self.keys):
            while len(d) > MAX_BANNED:
                del d[next(iter(d))]

    def key(self, key: str, reason: str, by: str) -> None:
        """A key that is no member now (it is refused when it tries to join)."""
        self.keys[key] = Banned("", None, reason, by, self.clock.time(), key)
        while len(self.keys) > MAX_BANNED:
            del self.keys[next(iter(self.keys))]

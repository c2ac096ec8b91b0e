"""The tracker: keyed membership and liveness, composed with standing (standing.py), bans (bans.py) and the
k trees its members sit in (forest.py: SplitStream groups, the layout, placement by measured uplink).

Within a tree the group forms an f-ary heap under the origin; every other peer hangs off a free slot,
shallowest first. Peers that can't relay (--no-relay, unreachable, or demoted) are leaves everywhere.

Identities are free, so a fresh key is trusted with nothing: members with standing (keys the trainer calls
established, and relays that have shown they upload) take the top of every tree and the first free slots;
fresh relays form a heap of their own below them, serving only other fresh peers, until they show they
upload. No fresh key ever sits between the origin and a peer with standing. Standing itself is
standing.py's; bans are bans.py's; the time is the clock given (sans-I/O: the origin passes the `time`
module, the simulator its own clock, so both drive this very object).
"""

from __future__ import annotations

import collections
import datetime
import secrets
from collections.abc import Callable

from .bans import Bans, TrackerError
from .forest import Children, Forest, Parents
from .messages import ORIGIN, Join, Joined, PeerHeartbeat, PeerView, TreeSources, TreeView
from .peer_rec import PeerRec
from .standing import Clock, ManualClock, Standing
from .uplink_line import UplinkLine

__all__ = ["PeerRec", "Tracker", "TrackerError"]
GIVEN_S = 120.0  # a source given to a member counts as one it may have received from for this long
MAX_GIVEN = 256  # sources remembered per member


class Tracker:
    def __init__(self, origin_url: str, trees: int, fanout: int, heartbeat_s: float = 2.0, *,
                 clock: Clock | None = None, max_peers: int = 1000, reserved_share: float = 0.0,
                 penalty_limit: float = 5.0, prove_bytes: int = 1 << 16, order_key: bytes | None = None,
                 token_hex: Callable[[int], str] = secrets.token_hex):
        """`clock`: monotonic() and time() (the `time` module; None: a ManualClock at 0, for tests);
        `order_key`: the layout's order among equals (forest.py; None: secret, a simulator passes its own);
        `token_hex`: where peer ids and tokens come from (a simulator passes a seeded one: runs repeat)."""
        if trees < 1 or fanout < 1:
            raise ValueError("trees and fanout must be >= 1")
        self.origin_url, self.trees, self.fanout = origin_url, trees, fanout
        self.heartbeat_s = heartbeat_s
        self.dead_after = 3 * heartbeat_s + 1.0
        self.clock = clock or ManualClock()
        self.max_peers, self.penalty_limit = max_peers, penalty_limit
        self.fresh_room = max_peers - int(reserved_share * max_peers)  # places fresh keys may fill
        self.peers: dict[str, PeerRec] = {}
        self._by_url: dict[str, PeerRec] = {}  # members by their relay address (every heartbeat looks up 64)
        self.standing = Standing(self.clock, penalty_limit, prove_bytes)
        self.bans = Bans(self.clock)
        self.refused: collections.Counter[str] = collections.Counter()
        self.events: collections.deque[str] = collections.deque(maxlen=200)
        self._seq = 0
        self._token_hex = token_hex
        self._vouching = (float("-inf"), False)  # (when looked, whether any member vouches)
        self.forest = Forest(self.peers, trees, fanout, self.tier, order_key)
        # who is first in each uplink's line (uplink_share.py paces the rest)
        self.line = UplinkLine(self.peers, self.forest, self.any_vouching, self.vouches)

    # -- what standing.py decides, and what the layout does about it ---------------------------------------
    trusted = property(lambda self: self.standing.trusted)
    proven = property(lambda self: self.standing.proven)
    banned = property(lambda self: self.bans.by_peer)
    banned_keys = property(lambda self: self.bans.keys)
    banned_urls = property(lambda self: self.bans.urls)

    def event(self, msg: str) -> None:
        self.events.append(f"{datetime.datetime.fromtimestamp(self.clock.time()):%H:%M:%S} {msg}")

    def count(self, reason: str, msg: str | None = None) -> None:
        self.refused[reason] += 1
        if msg:
            self.event(msg)

    def points(self, key: str) -> float:
        return self.standing.points(key)

    def penalize(self, key: str, why: str) -> None:
        """An unconfirmed report: it costs the reporter, never the accused."""
        self.standing.penalize(key)
        self.count("unconfirmed_report", f"unconfirmed report by {key[:12]}: {why}")

    def has_standing(self, rec: PeerRec) -> bool:
        return self.standing.has(rec.key)

    def set_trusted(self, key: str, trusted: bool = True) -> None:
        if not self.standing.trust(key, trusted):
            return
        if trusted:
            self.forest.relayout()
        elif any(p.key == key for p in self.peers.values()):
            self.forest.layout = None  # it may sit above peers with standing: not even for the rest of a version

    def prove(self, rec: PeerRec, how: str, earned: bool = False) -> None:
        """It has shown it uploads (`earned`: to receivers who vouch, standing.py)."""
        ranked = self.standing.ranked(rec.key)
        if self.standing.prove(rec.key, earned):
            if not ranked:
                self.forest.relayout()
            self.event(f"{rec.peer_id} {rec.name} has shown it uploads ({how})")

    def vouches(self, rec: PeerRec) -> bool:
        """What it says of others counts (standing.Standing.vouches)."""
        return self.standing.vouches(rec.key)

    def any_vouching(self) -> bool:
        """Does any member vouch (trusted, or earned)? Looked up at most once a second: a heartbeat asks."""
        now = self.clock.monotonic()
        if now - self._vouching[0] >= 1.0:
            self._vouching = (now, any(self.standing.vouches(p.key) for p in self.peers.values()))
        return self._vouching[1]

    def was_given(self, rec: PeerRec, url: str | None) -> bool:
        """Was `url` among the sources this member was given lately? Nobody else can have sent it pieces."""
        at = rec.given.get(url or "")
        return at is not None and self.clock.monotonic() - at <= GIVEN_S

    def _ranked(self, rec: PeerRec) -> bool:
        return self.standing.ranked(rec.key)

    def tier(self, rec: PeerRec) -> int:
        """Where the layout puts it (forest.py): 2 above the rest, 1 on trial (a few interior places, low in
        the trees, to earn standing), 0 a leaf. While any member vouches, only those who do are above: keys
        holding the origin's one-piece proof alone (which an attacker passes) are on trial; laid out above
        the honest relays they made every version after the first 2x slower (bench/tree_attacks_sim.py).
        Where nobody vouches (strangers alone), keys with that proof are above and fresh keys are leaves."""
        ranked = self._ranked(rec)
        return 2 if (self.vouches(rec) if self.any_vouching() else ranked) else int(ranked)

    # -- membership -----------------------------------------------------------------------------------
    def check_admission(self, key: str, url: str | None) -> None:
        """Refusals that need no network: a banned key or address, a full tracker."""
        if (refused := self.bans.refusal(key, url)) is not None:
            raise refused
        if any(p.key == key for p in self.peers.values()):
            return  # a rejoin replaces its own place
        ranked = self.standing.ranked(key)
        if len(self.peers) >= self.max_peers or not ranked and self._fresh() >= self.fresh_room:
            self.reap()
            if len(self.peers) >= self.max_peers:
                raise TrackerError(503, f"the tracker holds its maximum of {self.max_peers} peers", "full")
            if not ranked and self._fresh() >= self.fresh_room:
                raise TrackerError(503, f"the places left ({self.max_peers - len(self.peers)}) are kept for keys with "
                                   "standing: try again later", "full_for_fresh_keys")

    def _fresh(self) -> int:
        return sum(not self.standing.ranked(p.key) for p in self.peers.values())

    def url_holder(self, url: str, key: str) -> PeerRec | None:
        """The live member of another key holding `url`, if any."""
        p = self._by_url.get(url)
        return p if p is not None and p.key != key else None

    def join(self, msg: Join, *, key: str | None = None, url: str | None = None, reachable: bool | None = True,
             reach_error: str = "", observed_host: str = "") -> Joined:
        """Admit a member. `key` is its verified identity (None: an in-process caller, given a throwaway
        one); `url` its checked address (default msg.url); `reachable` what the connect-back found."""
        url = msg.url if url is None else url
        key = key or "anon-" + self._token_hex(8)
        self.check_admission(key, url)
        if url is not None and (holder := self.url_holder(url, key)) is not None:
            raise TrackerError(409, f"{url} is held by another live peer ({holder.peer_id})", "url_taken")
        for p in [p for p in self.peers.values() if p.key == key]:
            self.remove(p.peer_id, "rejoined")  # one live membership per key: a restart replaces it
        self._seq += 1
        relay = msg.relay and url is not None
        rec = PeerRec(self._token_hex(8), self._token_hex(16), msg.name[:64], url, relay, self._seq, key,
                      reachable=reachable if relay else None, reach_error=reach_error[:200],
                      last_hb=self.clock.monotonic(), addr=observed_host[:64])
        if rec.interior_capable:
            rec.group = self.forest.smallest_group()
        self.peers[rec.peer_id] = rec
        if rec.url is not None:
            self._by_url[rec.url] = rec
        self.forest.repair("add", rec.peer_id)
        self.event(f"join {rec.peer_id} {rec.name} {rec.url or '(no relay)'} key={key[:12]} group={rec.group}"
                   + ("" if rec.reachable is not False else " (not reachable: leaf)"))
        return Joined(rec.peer_id, rec.token, self.trees, self.heartbeat_s, rec.url, observed_host,
                      rec.reachable, rec.reach_error)

    def set_reachable(self, rec: PeerRec, reachable: bool, error: str = "") -> None:
        if rec.reachable == reachable:
            return
        rec.reachable, rec.reach_error = reachable, error[:200]
        if reachable and rec.interior_capable and rec.group is None:
            rec.group = self.forest.smallest_group()
            self.forest.relayout()
        elif not reachable:
            if rec.group is not None:
                rec.group = None
                self.forest.rebalance()
            self.forest.repair("make_leaf", rec.peer_id)
        self.event(f"{rec.peer_id} {rec.name} {'reachable again' if reachable else 'not reachable: leaf'}"
                   + (f" ({error})" if error else ""))

    def auth(self, peer_id: str, token: str) -> PeerRec:
        if peer_id in self.banned:
            raise TrackerError(410, f"peer {peer_id} was removed: {self.banned[peer_id].reason}")
        rec = self.peers.get(peer_id)
        if rec is None:
            raise TrackerError(404, f"unknown peer {peer_id}; join again")
        if not secrets.compare_digest(rec.token, token):
            raise TrackerError(403, "bad token")
        return rec

    def heartbeat(self, msg: PeerHeartbeat, latest: int | None) -> TreeSources:
        rec = self.auth(msg.peer_id, msg.token)
        now = rec.last_hb = self.clock.monotonic()
        rec.complete = sorted(msg.complete)[-64:]
        rec.progress = dict(list(msg.progress.items())[:64])
        rec.served_bytes = max(0, msg.served_bytes)
        # What it says it received counts only about sources it was given (a peer receives from nobody
        # else: attacker keys vouching for each other's uploads took the top of the tree, issue 29), except
        # from keys the trainer trusts.
        trusted = rec.key in self.standing.trusted
        if self.vouches(rec):
            # What it received from each parent: evidence that parent uploads, if the parent says so too.
            for url, n in list(msg.received.items())[:64]:
                src = self.by_url(url)
                if (src is not None and src is not rec and n > 0 and (trusted or self.was_given(rec, url))
                        and self.standing.confirm(src, rec.key, n)):
                    self.prove(src, f"{src.uploaded} bytes confirmed by its children", earned=True)
        # Placement by measured uplinks: a fresh key's numbers could be made up, so only standing counts;
        # and while any member vouches, only the figures of those who do: keys holding the origin's
        # one-piece proof alone, placed above each other, said they got each other's pieces at 12.5 GB/s and
        # took the top of the trees (issue 29, credit from friends; a ring of proofs lifts no one now).
        # Where nobody vouches, a stranger's figures from before its proof are kept, and count once it has it,
        # silences too (zero bytes over the seconds a source answered and sent nothing: its children's word
        # is all there is to place it by, upload_meter.UploadMeter.by_children). While members vouch, a silence
        # places no one: trials judge keys without standing, and an honest relay silent for a while (its
        # parent gone) is measured by what it sends.
        vouching = self.any_vouching()
        counts = self.vouches(rec) if vouching else self.has_standing(rec)
        if not vouching and self.forest.uploads.idle(rec.url or ""):
            # Its own children saw it give next to nothing: its word places no one. Believed, keys that send
            # nothing and say each parent they are given sent them nothing sank more honest relays each
            # version (N = 100 strangers, the sixth 4.3x; bench/tree_attacks_sim.py --attack sinkers).
            counts = False
        recent = {} if vouching and not counts else {
            u: r for u, r in msg.recent.items()
            if (trusted or u == ORIGIN or self.was_given(rec, u)) and (r.bytes > 0 or not vouching)}
        self.forest.note_uploads(rec, recent, latest, counts, majority=not vouching)
        sources = self.sources(rec.peer_id)
        for chain in sources:
            for url in chain:
                rec.given.pop(url, None)
                rec.given[url] = now  # re-inserted last: the bound forgets the oldest
        while len(rec.given) > MAX_GIVEN:
            del rec.given[next(iter(rec.given))]
        return TreeSources(latest, sources, rec.reachable, low=self.line.low_below(rec), trial=self._on_trial(sources))

    def _on_trial(self, sources: list[list[str]]) -> list[str]:
        """Which of these sources are on trial (tier 1: only a relay on trial is anyone's source)."""
        return sorted({u for chain in sources for u in chain if (s := self.by_url(u)) is not None and self.tier(s) == 1})

    def remove(self, peer_id: str, why: str) -> None:
        rec = self.peers.pop(peer_id, None)
        if rec is None:
            return
        if rec.url is not None and self._by_url.get(rec.url) is rec:
            del self._by_url[rec.url]
        self.forest.repair("remove", peer_id)
        if rec.group is not None:
            self.forest.rebalance()
        self.event(f"remove {peer_id} {rec.name} ({why})")

    def ban(self, peer_id: str, reason: str, reporter: str) -> None:
        rec = self.peers.get(peer_id)
        url, key = (rec.url, rec.key) if rec else (None, "")
        self.bans.member(peer_id, url, key, reason, reporter)
        self.remove(peer_id, f"banned: {reason}")

    def ban_key(self, key: str, reason: str, by: str = "trainer") -> None:
        """Ban an identity, member or not (the trainer's bans are the tree's too)."""
        members = [p.peer_id for p in self.peers.values() if p.key == key]
        for pid in members:
            self.ban(pid, reason, by)
        if not members:
            self.bans.key(key, reason, by)
        self.event(f"key {key[:12]} banned by {by}: {reason}")

    def demote(self, peer_id: str, why: str) -> None:
        rec = self.peers.get(peer_id)
        if rec and not rec.demoted:
            rec.demoted = True
            rec.group = None
            self.standing.revoke(rec.key)
            self.forest.trials.fail(rec.key, self.forest.latest)  # it earns its place again, not at once
            self.forest.repair("make_leaf", peer_id)
            self.forest.rebalance()
            self.event(f"demote {peer_id} to leaf ({why})")

    def end_trial(self, rec: PeerRec, why: str) -> None:
        """A relay on trial (tier 1) that a receiver who vouches found stalling: a leaf again, and its trial
        failed (trials.py). Nothing it had is lost: it had no standing above the fresh keys' own."""
        self.forest.trials.fail(rec.key, self.forest.latest)
        self.forest.repair("make_leaf", rec.peer_id)
        self.count("trial_ended", f"trial of {rec.peer_id} {rec.name} ended ({why})")

    def reap(self) -> list[str]:
        now = self.clock.monotonic()
        dead = [p.peer_id for p in self.peers.values() if now - p.last_hb > self.dead_after]
        for pid in dead:
            self.remove(pid, "heartbeat timeout")
        return dead

    def reach_rechecks(self, every: float = 30.0, at_once: int = 2) -> list[PeerRec]:
        """Relays found unreachable, due to be connected back to again (at most `at_once`, each `every` s)."""
        now, due = self.clock.monotonic(), []
        for rec in self.peers.values():
            if rec.relay and rec.reachable is False and now - rec.rechecked > every and len(due) < at_once:
                rec.rechecked = now
                due.append(rec)
        return due

    def by_url(self, url: str) -> PeerRec | None:
        return self._by_url.get(url)

    # -- the trees (forest.py) ----------------------------------------------------------------------------
    uploads = property(lambda self: self.forest.uploads)
    latest = property(lambda self: self.forest.latest)

    def topology(self) -> tuple[Parents, Children]:
        """Per tree: parent of each peer (None = origin) and children of each node (None key = origin)."""
        return self.forest.topology()

    def sources(self, peer_id: str) -> list[list[str]]:
        return self.forest.sources(peer_id)

    def in_flight(self) -> bool:
        return self.forest.in_flight()

    def probed(self, rec: PeerRec, rate: float) -> None:
        """The origin timed a download from this relay (uplink_plan.py): the next layout uses it."""
        self.forest.probed(rec, rate)

    def view(self, latest: int | None, versions: list[int]) -> TreeView:
        parents, children = self.topology()
        now = self.clock.monotonic()
        peers = [
            PeerView(
                # One that nobody can reach is a download-only leaf, and shown so (it asked to relay).
                p.peer_id, p.name, p.url, p.relay and p.reachable is not False, p.group, p.complete, p.progress, round(now - p.last_hb, 2),
                p.strikes, [parents[t].get(p.peer_id) for t in range(self.trees)],
                [children[t].get(p.peer_id, []) for t in range(self.trees)],
                key=p.key, reachable=p.reachable, reach_error=p.reach_error, standing=self.has_standing(p),
                proven=p.key in self.proven, uploaded=p.uploaded, demoted=p.demoted,
                uplink=self.uploads.uplink(p.url or ""),
                uplink_probed=(p.url or "") not in self.uploads.placed and (p.url or "") in self.uploads.probed,
                tier=self.tier(p))
            for p in sorted(self.peers.values(), key=lambda p: p.seq)
        ]
        return TreeView(self.origin_url, self.trees, self.fanout, latest, versions,
                        [children[t].get(None, []) for t in range(self.trees)], peers,
                        list(self.banned_keys.values())[-100:], list(self.events), dict(self.refused))

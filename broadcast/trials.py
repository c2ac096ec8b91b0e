"""Relays on trial (sans-I/O): how a key without standing earns a place inside the trees, and loses the chance.

While some members vouch, only they are laid out above the rest (tracker.Tracker.tier); a key that holds
the origin's one-piece proof but no receiver's confirmation is on trial: in each version's measured layout
at most TRIAL_SHARE of a tree's relays (at least one) get TRIAL_CHILDREN places, below the measured relays
and never the origin's (placement.Candidate.trial), neither probed nor placed by a probe's figure, so
receivers who vouch can confirm what it sends and it earns standing (standing.py). Its child gives it one
usual piece latency (sourcing.SourceBook.on_trial) and, reporting it stalling, ends the trial
(verdicts.judge_report). A trial that ends with children who vouch and no byte they confirm is failed, as is
one ended so, or a key demoted: no other for FAILED_VERSIONS versions. Identities are free, so each new key
costs its maker a proof and then a trial at most, in a bounded share of places.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .peer_rec import PeerRec

TRIAL_SHARE = 0.1  # of a tree's relays, at most, on trial at once
TRIAL_CHILDREN = 1  # places a relay on trial gets: one receiver who vouches judges it, one at most waits on it
FAILED_VERSIONS = 10  # a failed trial's key waits this many versions for another
MAX_FAILED = 10_000  # failed keys remembered


class Trials:
    def __init__(self) -> None:
        # peer_id -> (key, what it had uploaded at the start, the version it was laid out for)
        self.running: dict[str, tuple[str, int, int]] = {}
        self.failed: dict[str, int] = {}  # key -> the version its trial failed in

    def pick(self, ordered: Iterable[PeerRec], tier: Callable[[PeerRec], int], group_sizes: list[int],
             placed: set[str], latest: int | None) -> set[str]:
        """The relays on trial in the next layout (peer ids), in the order given; `placed`: those laid out
        already (standing, or a measured uplink)."""
        room = [max(1, int(TRIAL_SHARE * n)) for n in group_sizes]
        out: set[str] = set()
        for p in ordered:
            if (p.peer_id in placed or not p.interior_capable or p.group is None or room[p.group] <= 0
                    or tier(p) != 1 or not self._may(p.key, latest)):
                continue
            out.add(p.peer_id)
            room[p.group] -= 1
        return out

    def _may(self, key: str, latest: int | None) -> bool:
        at = self.failed.get(key)
        return at is None or latest is None or latest - at >= FAILED_VERSIONS

    def started(self, trial: set[str], peers: dict[str, PeerRec], vouched: Callable[[str], bool],
                version: int | None) -> None:
        """A layout for `version` in flight is made (None: none is in flight; a layout between versions
        carries none): each relay on trial with children who vouch (`vouched(peer_id)`) is judged once
        that version is over."""
        if version is None:
            return
        for pid in trial:
            if pid not in self.running and vouched(pid):
                self.running[pid] = (peers[pid].key, peers[pid].uploaded, version)

    def fail(self, key: str, version: int | None) -> None:
        self.failed.pop(key, None)  # re-inserted last: the bound forgets the oldest
        self.failed[key] = version or 0
        self.running = {pid: r for pid, r in self.running.items() if r[0] != key}

    def judge(self, peers: dict[str, PeerRec], in_flight: int | None) -> None:
        """A new layout is due (`in_flight`: the version then in flight, if any): the trials whose version is
        over end, failed when their receivers confirmed nothing."""
        for pid, (key, before, version) in list(self.running.items()):
            if version == in_flight:
                continue  # laid out again mid-version (a key's trust changed): still running
            del self.running[pid]
            rec = peers.get(pid)
            if rec is not None and rec.key == key and rec.uploaded <= before:
                self.fail(key, version)
        while len(self.failed) > MAX_FAILED:
            del self.failed[next(iter(self.failed))]

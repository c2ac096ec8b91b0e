"""Probation: a new key's accepted groups wait in quarantine until the paired reward test clears it.

This class owns the quarantine and the per-node count of groups delivered on probation; nothing else
writes them. The verdicts themselves are the guard's (trainer/guard.py); what a verdict does to the
node's groups (release to the learner's buffer, or drop) is decided here and carried out by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.guard import Guard
from trainer.intake import Group


@dataclass
class Review:
    """What a review decided: groups released to the learner, and per caught node the groups dropped."""

    released: dict[str, list[Group]] = field(default_factory=dict)
    caught: dict[str, list[Group]] = field(default_factory=dict)
    stale: list[Group] = field(default_factory=list)


class Probation:
    def __init__(self, guard: Guard, probation_groups: int):
        self.guard = guard
        self.probation_groups = probation_groups  # 0: no probation at all
        self.quarantine: list[Group] = []  # accepted from nodes on probation, not yet released
        self.delivered: dict[str, int] = {}  # node on probation -> groups it delivered while on it

    def holds(self, node_id: str) -> bool:
        return node_id in self.delivered

    def waiting(self, node_id: str) -> int:
        return sum(1 for g in self.quarantine if g.node_id == node_id)

    def begin(self, node_id: str) -> None:
        """A key seen for the first time starts on probation; a re-registration changes nothing, and the
        groups it delivered before a trainer restart (back in quarantine, audited) count."""
        if self.probation_groups <= 0 or self.guard.is_established(node_id):
            return
        self.delivered[node_id] = max(self.delivered.get(node_id, 0), self.waiting(node_id))

    def forget(self, node_id: str) -> None:
        """A silent key with nothing in quarantine is forgotten: if it returns, its probation starts over."""
        if not self.waiting(node_id):
            self.delivered.pop(node_id, None)

    def admit(self, node_id: str, groups: list[Group]) -> None:
        self.quarantine.extend(groups)
        self.delivered[node_id] += len(groups)

    def restore(self, groups: list[Group]) -> None:
        """Groups of keys that had not passed probation when the trainer stopped: they wait for that key's
        verdict again."""
        self.quarantine.extend(groups)

    def take(self, pred: Callable[[Group], bool]) -> list[Group]:
        """Take the quarantined groups that match `pred` out of quarantine."""
        out = [g for g in self.quarantine if pred(g)]
        if out:
            self.quarantine = [g for g in self.quarantine if not pred(g)]
        return out

    def end(self, node_id: str) -> list[Group]:
        """The node leaves probation without a release (it was banned): its quarantined groups, to drop."""
        self.delivered.pop(node_id, None)
        return self.take(lambda g: g.node_id == node_id)

    def review(self, oldest: int, has_partner: Callable[[str], bool]) -> Review:
        """Release nodes the paired test cleared, give up those it caught, take out what went stale
        (older than version `oldest`)."""
        out = Review(stale=self.take(lambda g: g.version < oldest))
        for node_id in list(self.delivered):
            verdict = self.guard.probation_verdict(node_id, self.delivered[node_id], has_partner(node_id))
            if verdict in ("released", "released_unchecked"):
                del self.delivered[node_id]
                self.guard.establish(node_id, checked=verdict == "released")
                out.released[node_id] = self.take(lambda g, n=node_id: g.node_id == n)
            elif verdict == "cherry_picking" and self.waiting(node_id):
                out.caught[node_id] = self.take(lambda g, n=node_id: g.node_id == n)
        return out

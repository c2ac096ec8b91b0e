"""Keys that are not established yet, from their first group to their verdict, and what the verdict does.

The quarantine is trainer/probation.py's and the verdicts are trainer/guard.py's; this class reviews them
(after every accepted submission, every reference answer and every sweep of the node service), carries
out what they decide (a released key's groups go to the learner and it gains standing in the relay tree;
a caught key's are dropped and it is struck), feeds the trainer's own reference samples into the paired
test when `guard.reference` is on (trainer/reference.py), and says where the operator looks when
newcomers wait with nobody to be paired with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from trainer.config import RunConfig
from trainer.guard import REFERENCE, Guard
from trainer.intake import Group
from trainer.node_registry import NodeRegistry
from trainer.probation import Probation
from trainer.reference import Drawn, Reference
from trainer.stats import RunStats
from trainer.work import WorkHandout

log = logging.getLogger(__name__)

WARN_EVERY_S = 60.0

FIX_UNPAIRED = ("give the run a reference of its own: swarm train --reference (guard.reference = true), or run "
                "a node yourself and trust its key: swarm train --trust KEY (swarm node prints its key)")


def warn_about_strangers(cfg: RunConfig, guard: Guard) -> None:
    """At start-up: how keys the operator does not run will be checked, and what to do when they cannot be."""
    g = cfg.guard
    if g.release_unpaired:
        log.warning("guard.release_unpaired is on: a node with no reference to be paired with is released after "
                    "%d audited groups, unchecked for cherry-picking (two colluding keys can release each other). "
                    "Keep it for labs and closed runs; for an open run use --reference instead.", g.probation_groups)
    if g.reference:
        log.info("guard.reference is on: the trainer samples the prompts of nodes on probation itself (at most "
                 "%.0f%% of one thread's time) and pairs them with that", 100 * g.reference_budget)
    elif not (g.trusted or guard.established or g.release_unpaired or g.probation_groups <= 0):
        log.warning("no node key is trusted and the run has no reference of its own: every node that joins is a "
                    "stranger on probation, and its work waits in quarantine (nothing trains) until a trusted or "
                    "established node is live to be paired with. To fix it, %s.", FIX_UNPAIRED)


class Pairing(msgspec.Struct, kw_only=True):
    """Whether newcomers can be paired now: what the summary, /metrics and the web view show."""

    reference: bool  # the trainer samples references itself (guard.reference)
    partners: int  # live established or trusted nodes
    on_probation: int  # keys on probation now
    waiting_keys: int  # keys on probation with nobody to be paired with
    waiting_groups: int  # their groups in quarantine
    release_unpaired: bool  # guard.release_unpaired: keys with no partner released unchecked (a lab setting)
    reference_groups: int = 0  # groups the reference sampled
    reference_seconds: float = 0.0  # time it spent on them


class Newcomers:
    def __init__(self, cfg: RunConfig, guard: Guard, registry: NodeRegistry, work: WorkHandout,
                 probation: Probation, stats: RunStats, reference: Reference | None,
                 release: Callable[[list[Group]], None], drop: Callable[[list[Group], str], None],
                 strike: Callable[[str, str], None], standing: Callable[[str], None]):
        self.cfg, self.guard, self.registry, self.work = cfg, guard, registry, work
        self.probation, self.stats, self.reference = probation, stats, reference
        self.release, self.drop, self.strike, self.standing = release, drop, strike, standing
        self._warned = -1e9
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.reference is not None:
            self._task = asyncio.create_task(self.reference.run(self._wants_reference, self._referenced))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ---- partners ------------------------------------------------------------------------------------

    def partners(self) -> int:
        """Live established or trusted nodes (not those released unchecked): the references newcomers can
        share prompts with."""
        return sum(1 for k in self.guard.established | self.guard.cfg.trusted
                   if self.guard.is_reference(k) and self.registry.live(k))

    def can_pair(self) -> bool:
        """Can a key on probation be paired now (the trainer's reference, or a live established node)?"""
        return self.reference is not None or self.partners() > 0

    def pairing(self) -> Pairing:
        partners = self.partners()
        paired = self.reference is not None or partners > 0
        keys = list(self.probation.delivered)
        return Pairing(reference=self.reference is not None, partners=partners, on_probation=len(keys),
                       waiting_keys=0 if paired else len(keys),
                       waiting_groups=0 if paired else len(self.probation.quarantine),
                       release_unpaired=self.guard.cfg.release_unpaired,
                       reference_groups=self.reference.groups if self.reference else 0,
                       reference_seconds=round(self.reference.seconds, 3) if self.reference else 0.0)

    # ---- the trainer's reference -----------------------------------------------------------------------

    def quarantined(self, groups: list[Group]) -> None:
        """A key on probation delivered these (audited, in quarantine)."""
        if self.reference is not None and groups:
            self.reference.request(groups)

    def _wants_reference(self, g: Group) -> bool:
        return self.probation.holds(g.node_id) and g.version >= self.work.version - self.cfg.train.max_lag

    def _referenced(self, d: Drawn) -> None:
        self.guard.pairs.add(d.group.item.id, REFERENCE, d.group.version, d.rewards)
        self.review()

    # ---- verdicts ------------------------------------------------------------------------------------

    def review(self) -> None:
        """Release keys the paired test cleared, drop and strike those it caught, drop what went stale."""
        oldest = self.work.version - self.cfg.train.max_lag
        # Answers too old to be compared with anything still to come are let go.
        self.guard.pairs.forget_before(oldest - self.guard.cfg.pair_window)
        has_partner = self.can_pair()
        review = self.probation.review(oldest, lambda node_id: has_partner)
        if review.stale:
            self.drop(review.stale, "stale_in_quarantine")
            log.info("dropped %d quarantined groups that went stale", len(review.stale))
        for node_id, groups in review.released.items():
            self.release(groups)
            self.standing(node_id)
            if (rec := self.registry.get(node_id)) is not None:
                rec.standing = "established"
            n, z = self.guard.pairs.z(node_id)
            log.info("node %s passed probation (%d shared prompts, z %.2f): %d groups released",
                     node_id[:12], n, z, len(groups))
        for node_id, groups in review.caught.items():
            self.drop(groups, "cherry_picking")
            for _ in groups:
                self.stats.refuse(self.registry.get(node_id), "cherry_picking")
            n, z = self.guard.pairs.z(node_id)
            log.warning("node %s: reward excess over its references on %d shared prompts (z %.1f): "
                        "cherry-picking; %d quarantined groups dropped", node_id[:12], n, z, len(groups))
            self.strike(node_id, "cherry_picking")
        self.stats.quarantined = len(self.probation.quarantine)
        if not has_partner:
            self._warn_unpaired()

    def _warn_unpaired(self) -> None:
        """Say so, once a minute, while keys wait on probation with nobody to be paired with."""
        waiting = len(self.probation.delivered)
        if not waiting or time.monotonic() < self._warned + WARN_EVERY_S:
            return
        self._warned = time.monotonic()
        if self.guard.cfg.release_unpaired:
            log.warning("%d node(s) on probation with no reference: guard.release_unpaired is on, so they are "
                        "released after guard.probation_groups audited groups, unchecked for cherry-picking",
                        waiting)
            return
        log.warning("%d node(s) on probation and nobody to pair them with: their %d groups wait in quarantine "
                    "and nothing of theirs trains. To fix it, %s.", waiting, len(self.probation.quarantine),
                    FIX_UNPAIRED)

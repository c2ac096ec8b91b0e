"""Handing out work, paced: which prompt goes to which node, how much, and with which policy version.

No more than `inflight_groups` groups are assigned or waiting for the learner at once, so little work
goes stale. Work not answered in time goes back to the front of the queue for someone else. Some
prompts (all of a node on probation's) go to two nodes, for the paired reward test (trainer/guard.py).

The pacing follows the learner through two calls of the trainer's: `begin_step()` when a step starts
making version newest + 1, `end_step(version)` when it is made (before it is published).
"""

from __future__ import annotations

import collections
import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rewards.base import TaskItem
from swarm_common import protocol as P
from trainer.checkpoint import restore_rng, rng_state
from trainer.intake import Held


@dataclass(frozen=True)
class Shared:
    """A prompt handed to one node that a second node should answer too (the paired reward test)."""

    item: TaskItem
    first: str  # the node that has it
    version: int  # the announced version when it was handed out: its answer is sampled at about that


class WorkHandout:
    def __init__(self, items: Iterator[TaskItem], encode: Callable[[TaskItem], list[int]], sampling: P.SamplingSpec,
                 *, inflight_groups: int, max_lag: int, work_lag: int, max_held: int, duplicate_share: float,
                 probation_groups: int, assignment_timeout_s: float, seed: int, pair_window: int = 2,
                 is_reference: Callable[[str], bool] = lambda node_id: True):
        self.items, self.encode, self.sampling = items, encode, sampling
        self.is_reference = is_reference  # keys whose answers the paired test compares with (trainer/guard.py)
        # Multi-turn work: the environment named in every hand-out, and what a node gets of each item.
        self.env: P.EnvSpec | None = None
        self.episode_item: Callable[[TaskItem], P.EpisodeItem] | None = None
        self.inflight_groups, self.max_lag, self.work_lag = inflight_groups, max_lag, work_lag
        self.max_held, self.duplicate_share = max_held, duplicate_share
        self.probation_groups, self.assignment_timeout_s = probation_groups, assignment_timeout_s
        self.pair_window = pair_window  # the paired test compares answers at most this many versions apart
        self.rng = random.Random(seed + 17)
        self.retry: collections.deque[TaskItem] = collections.deque()  # prompts whose work expired
        self.dups: collections.deque[Shared] = collections.deque()  # prompts for a second node, oldest first
        self.held: dict[str, Held] = {}
        self.expired: collections.OrderedDict[str, None] = collections.OrderedDict()  # recently expired ids
        self.items_drawn = 0
        self.version = 0  # the newest version announced to nodes
        self.newest = 0  # the newest version the learner has made (announced, or being published)
        self.training = False  # a learner step is making version newest + 1
        self.closed = False  # the run is over: no work out

    # ---- the learner's side -----------------------------------------------------------------------

    def announce(self, version: int) -> None:
        """`version` is out: nodes may load it."""
        self.version = version

    def start_at(self, version: int) -> None:
        """The run starts (or resumes) with `version` published and nothing being made."""
        self.version = self.newest = version

    def close(self) -> None:
        """The run is over: no more work goes out."""
        self.closed = True

    def begin_step(self) -> None:
        """A step is making version newest + 1: work handed out from now on is trained on from it."""
        self.training = True

    def end_step(self, version: int) -> None:
        """The step made `version` (being published now): with work_lag 0 new work waits for it."""
        self.newest, self.training = version, False

    def state(self) -> tuple[int, list[TaskItem], str]:
        """(prompts drawn, prompts to hand out again, the RNG) for a checkpoint: held work counts as unanswered."""
        return self.items_drawn, list(self.retry) + [h.item for h in self.held.values()], rng_state(self.rng)

    def restore(self, items_drawn: int, retry: list[TaskItem], rng: str) -> None:
        self.items_drawn = items_drawn
        self.retry.extend(retry)
        restore_rng(self.rng, rng)

    # ---- handing out --------------------------------------------------------------------------------

    def floor(self) -> int:
        """The oldest policy new work may be generated with: within max_lag of the announced version and
        within work_lag of the newest the learner has made. Above self.version, work waits for an announcement.

        While a step is making version newest + 1, work handed out now can only be trained on from that
        version on: anything older than newest + 1 - max_lag would be dropped as stale on arrival. With
        max_lag 0 (on-policy) this keeps the nodes idle during a step instead of generating batches that
        are thrown away (and that take CPU from the learner on a shared machine)."""
        trained_from = self.newest + 1 if self.training else self.newest
        return max(0, self.version - self.max_lag, self.newest - self.work_lag, trained_from - self.max_lag)

    def held_by(self, node_id: str) -> int:
        return sum(1 for h in self.held.values() if h.node_id == node_id)

    def room(self, node_id: str, waiting: int, on_probation: bool, quarantined: int, blank: int = 0) -> int:
        """How many more groups `node_id` may be assigned now, with `waiting` accepted groups not yet
        trained on in all and `quarantined` of this node's waiting for its probation verdict, `blank` of its
        shared prompts compared without evidence (both groups alike and all alike)."""
        if self.closed:
            return 0
        mine = self.held_by(node_id)
        room = min(self.inflight_groups - len(self.held) - waiting, self.max_held - mine)
        if on_probation:
            # On probation a node has at most probation_groups out or waiting in quarantine at once, and one
            # more for each blank comparison (up to 4x in all): those bring its verdict no nearer, and while
            # nothing trains (strangers alone) nothing leaves the quarantine, so a cap of probation_groups
            # would leave a node short of evidence waiting for ever (measured: 2 strangers, 16 groups each
            # in quarantine, the run at step 0 after 8 minutes).
            cap = self.probation_groups + min(blank, 3 * self.probation_groups)
            room = min(room, cap - mine - quarantined)
        return room

    def assign(self, req: P.WorkRequest, room: int, on_probation: bool, weights: P.WeightsInfo) -> P.WorkAssignment:
        floor = self.floor()
        min_version = min(floor, self.version)  # what the node must load before it asks again
        n = min(req.max_prompts, room) if req.version_loaded >= floor else 0
        out = []
        deadline = time.monotonic() + self.assignment_timeout_s
        for _ in range(max(n, 0)):
            item = self._next_item(req.node_id, on_probation)
            aid = uuid.uuid4().hex[:16]
            ids = self.encode(item)
            self.held[aid] = Held(aid, req.node_id, item, ids, self.version, deadline)
            out.append(P.Assignment(assignment_id=aid, prompt_token_ids=ids,
                                    item=self.episode_item(item) if self.episode_item else None))
        return P.WorkAssignment(weights=weights, min_version=min_version, assignments=out, sampling=self.sampling,
                                retry_after_s=0.0 if out else 0.25, env=self.env)

    def _next_item(self, node_id: str, on_probation: bool) -> TaskItem:
        # A prompt another node already has comes first: the paired reward test needs shared prompts, and a
        # node on probation waits for them. Two keys that are not references never share one: a pair of
        # new keys could be one cheater's, and would vouch for each other. The newest first: the test
        # compares answers of close policy versions only, so one handed out too long ago pairs with nothing.
        self._drop_unpairable()
        mine_trusted = self.is_reference(node_id)
        for i in range(len(self.dups) - 1, -1, -1):
            d = self.dups[i]
            if d.first != node_id and (mine_trusted or self.is_reference(d.first)):
                del self.dups[i]
                return d.item
        if self.retry:
            item = self.retry.popleft()
        else:
            self.items_drawn += 1
            item = next(self.items)
        # Every prompt of a node on probation is shared; an established node's now and then.
        if on_probation or self.rng.random() < self.duplicate_share:
            self.dups.append(Shared(item, node_id, self.version))
            while len(self.dups) > 4 * max(64, self.probation_groups):
                self.dups.popleft()
        return item

    def _drop_unpairable(self) -> None:
        """Shared prompts handed out at a version more than pair_window below the oldest policy new work
        may use: any answer now would be too far from the first one's to compare."""
        oldest = self.floor() - self.pair_window
        while self.dups and self.dups[0].version < oldest:
            self.dups.popleft()

    # ---- answers and expiry ---------------------------------------------------------------------------

    def answered(self, assignment_id: str, node_id: str) -> Held | None:
        """The assignment `node_id` answers, taken off the held list (answered, well or not: never again);
        None when this node holds no such assignment."""
        held = self.held.get(assignment_id)
        if held is None or held.node_id != node_id:
            return None
        return self.held.pop(assignment_id)

    def was_expired(self, assignment_id: str) -> bool:
        return assignment_id in self.expired

    def requeue(self, item: TaskItem) -> None:
        """The prompt goes to someone else."""
        self.retry.append(item)

    def take_back(self, node_id: str) -> None:
        """Everything `node_id` holds goes to others (it was banned)."""
        for aid in [a for a, h in self.held.items() if h.node_id == node_id]:
            self.retry.append(self.held.pop(aid).item)

    def expire(self, gone: set[str]) -> list[Held]:
        """Work past its deadline, or held by a node gone silent, goes back to the queue; a late answer
        is refused as `late`. Returns what expired."""
        now = time.monotonic()
        late = [h for h in self.held.values() if h.deadline < now or h.node_id in gone]
        for h in late:
            del self.held[h.assignment_id]
            self.retry.append(h.item)
            self.expired[h.assignment_id] = None
        while len(self.expired) > 10_000:
            self.expired.popitem(last=False)
        return late

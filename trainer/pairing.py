"""The paired reward test's evidence: per node, how its mean reward on a prompt compares with a reference's.

Cherry-picking (sampling many completions and returning the best G) leaves honest-looking log-probs, so
the only trace it leaves is rewards that beat what the same policy gets on the same prompt. Some prompts
go to two nodes (all of a new key's); each shared prompt gives a difference d = (the node's mean reward)
- (the reference's). An honest node's differences average zero; a cherry-picker's are positive.

Like with like, or the test is unfair:
- Same policy. The policy improves while a run learns, so an answer sampled many versions ago is beaten
  by today's policy without any cheating (an honest node that joined a run at step 388 was banned this
  way, its partner's answers hundreds of versions old). Two answers are compared only when their versions
  are at most `window` apart: the drift over a few versions is a small fraction of a difference's noise
  (docs/benchmarks.md, "The paired test while the policy improves").
- A reference that counts. A difference counts toward a node's test only when the other answer came
  from a reference: an established or trusted key, or the trainer's own samples. A fresh key's answers
  count for nothing, so two new keys cannot vouch for each other, and nothing a fresh key sends (say,
  deliberately bad answers on shared prompts) can make an established node look like a cheater.

z is the summed differences over their standard error. The variance of each difference is taken from
the two groups themselves (each group's reward variance over its G samples, / G), G samples a side
instead of one difference a prompt: at a dozen prompts a t-statistic's heavy tails alone would ban about
one honest node in a thousand at z > 4. Where the groups' own spread is too small to be trusted (groups
all right or all wrong), the spread of the differences across prompts bounds it from below.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Answer:
    node_id: str
    version: int
    mean: float  # the group's mean reward
    var: float  # the variance of that mean: the group's sample variance of rewards / G


def answer(node_id: str, version: int, rewards: list[float]) -> Answer:
    g = len(rewards)
    mean = sum(rewards) / g
    var = sum((r - mean) ** 2 for r in rewards) / (g - 1) / g if g > 1 else 0.0
    return Answer(node_id, version, mean, var)


class PairedRewards:
    def __init__(self, window: int, is_reference: Callable[[str], bool] = lambda node_id: True):
        self.window = window  # largest version gap between two answers that are compared
        self.is_reference = is_reference  # whose answers count as the yardstick
        self.by_item: dict[str, list[Answer]] = {}
        self._order: deque[tuple[int, str]] = deque()  # (version, item) as answers came, for forgetting
        self.compared: Counter = Counter()  # shared prompts compared, evidence or not
        self.n: Counter = Counter()  # those that carry evidence
        self.s: Counter = Counter()  # sum of differences
        self.ss: Counter = Counter()  # sum of squared differences
        self.v: Counter = Counter()  # sum of the differences' variances, from the groups themselves

    def add(self, item_id: str, node_id: str, version: int, rewards: list[float]) -> None:
        new = answer(node_id, version, rewards)
        seen = self.by_item.setdefault(item_id, [])
        for old in seen:
            if old.node_id == node_id or abs(old.version - version) > self.window:
                continue
            var = new.var + old.var
            if self.is_reference(old.node_id):
                self._record(node_id, new.mean - old.mean, var)
            if self.is_reference(node_id):
                self._record(old.node_id, old.mean - new.mean, var)
        seen.append(new)
        self._order.append((version, item_id))

    def _record(self, node_id: str, d: float, var: float) -> None:
        self.compared[node_id] += 1
        if d == 0.0 and var == 0.0:
            return  # both groups alike and all alike (all right, say): no evidence either way
        self.n[node_id] += 1
        self.s[node_id] += d
        self.ss[node_id] += d * d
        self.v[node_id] += var

    def forget_before(self, version: int) -> None:
        """Answers older than `version` can no longer be paired with new ones: let them go."""
        while self._order and self._order[0][0] < version:
            _, item_id = self._order.popleft()
            kept = [a for a in self.by_item.get(item_id, []) if a.version >= version]
            if kept:
                self.by_item[item_id] = kept
            else:
                self.by_item.pop(item_id, None)

    def forget_node(self, node_id: str) -> None:
        """A key the trainer forgot: its evidence goes with it (it starts again if it comes back)."""
        for c in (self.compared, self.n, self.s, self.ss, self.v):
            c.pop(node_id, None)

    def z(self, node_id: str) -> tuple[int, float]:
        n = self.n[node_id]
        if n < 2:
            return n, 0.0
        total = self.s[node_id]
        mean = total / n
        spread = max(0.0, (self.ss[node_id] - n * mean * mean) / (n - 1) * n)  # the differences' own estimate
        # The groups' own estimate, bounded below by half the differences' (should a node's samples within a
        # group not be independent draws, its groups would understate the noise) and by a floor: identical
        # rewards are not infinite evidence.
        var = max(self.v[node_id], 0.5 * spread, 1e-4 * n)
        return n, total / math.sqrt(var)

"""Tasks and rubrics: a task is seeded data plus a verifier; a reward is a plain function.

A reward function takes (item, completion text) and returns a score in [0, 1]. A rubric is a weighted
list of them; its score is the weighted mean, and every function's score is reported as a named metric.
Rewards are pure: the trainer recomputes them from the completion text and never trusts a node's figure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec


class TaskItem(msgspec.Struct, frozen=True):
    """One prompt with everything its verifier needs."""

    id: str
    prompt: str  # the user's message, before any chat template
    answer: str  # the reference answer, as text
    meta: dict[str, str] = {}


RewardFn = Callable[[TaskItem, str], float]


class Score(msgspec.Struct, frozen=True):
    reward: float  # the rubric's weighted score, in [0, 1]
    metrics: dict[str, float]  # each reward function's own score, by name


@dataclass(frozen=True)
class Rubric:
    """A weighted list of reward functions."""

    funcs: Sequence[tuple[str, RewardFn, float]]

    def score(self, item: TaskItem, completion: str) -> Score:
        metrics: dict[str, float] = {}
        total = weight = 0.0
        for name, fn, w in self.funcs:
            s = float(fn(item, completion))
            if not 0.0 <= s <= 1.0:
                raise ValueError(f"reward {name} returned {s}, outside [0, 1]")
            metrics[name] = s
            total += w * s
            weight += w
        return Score(reward=total / weight if weight else 0.0, metrics=metrics)


@dataclass
class Task:
    """A deterministic, seeded prompt source and its verifier.

    `train_items(seed)` yields an endless stream; `eval_items(n)` is a fixed held-out set that never
    appears in training (tasks split their item space so the two cannot overlap).
    """

    name: str
    rubric: Rubric
    system_prompt: str | None = None
    correct_metric: str = "correct"  # which metric counts as accuracy in evaluation
    params: dict = field(default_factory=dict)

    def train_items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        raise NotImplementedError

    def eval_items(self, n: int) -> list[TaskItem]:
        raise NotImplementedError

    def score(self, item: TaskItem, completion: str) -> Score:
        return self.rubric.score(item, completion)

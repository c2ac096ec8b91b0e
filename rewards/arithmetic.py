"""Integer arithmetic: `a op b`, with a difficulty knob (operand digits, operators, operand count).

The item space is split by a hash of the problem, so held-out evaluation problems never appear in
training. Everything is a pure function of the seed: no data files, no downloads.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator

from rewards.base import Rubric, Task, TaskItem

_INT = re.compile(r"-?\d+")
_ONLY_INT = re.compile(r"\s*-?\d+\s*\.?\s*")


def final_integer(text: str) -> int | None:
    """The last integer in a completion, which we take as its answer."""
    found = _INT.findall(text)
    if not found or len(found[-1]) > 40:
        return None
    return int(found[-1])


def correct(item: TaskItem, completion: str) -> float:
    """1 when the completion's final integer equals the reference answer."""
    value = final_integer(completion)
    return 1.0 if value is not None and str(value) == item.answer else 0.0


def digits_match(item: TaskItem, completion: str) -> float:
    """Partial credit: the share of digit places (aligned from the units) that match the answer.

    A denser signal than exact match, so a group of G samples rarely scores all alike."""
    value = final_integer(completion)
    if value is None:
        return 0.0
    got, want = str(value), item.answer
    same = sum(a == b for a, b in zip(reversed(got), reversed(want), strict=False))
    return same / max(len(got), len(want))


def format_ok(item: TaskItem, completion: str) -> float:
    """1 when the completion is just a number (the format the prompt asks for)."""
    return 1.0 if _ONLY_INT.fullmatch(completion) else 0.0


def _is_eval(expr: str, eval_share: float) -> bool:
    h = int.from_bytes(hashlib.sha256(expr.encode()).digest()[:8], "big")
    return h / 2**64 < eval_share


class ArithmeticTask(Task):
    def __init__(
        self,
        digits: int = 2,
        ops: str = "+",
        terms: int = 2,
        eval_share: float = 0.1,
        correct_weight: float = 1.0,
        digits_weight: float = 0.5,
        format_weight: float = 0.1,
        template: str = "{expr}",
    ):
        if not 1 <= digits <= 9 or not 2 <= terms <= 6 or not set(ops) <= set("+-*") or not ops:
            raise ValueError("arithmetic: digits in 1..9, terms in 2..6, ops a subset of '+-*'")
        super().__init__(
            name="arithmetic",
            rubric=Rubric(
                [
                    ("correct", correct, correct_weight),
                    ("digits", digits_match, digits_weight),
                    ("format", format_ok, format_weight),
                ]
            ),
            params={"digits": digits, "ops": ops, "terms": terms, "eval_share": eval_share},
        )
        self.digits, self.ops, self.terms = digits, ops, terms
        self.eval_share, self.template = eval_share, template

    def _make(self, rng: random.Random) -> tuple[str, int]:
        hi = 10**self.digits - 1
        nums = [rng.randint(0, hi) for _ in range(self.terms)]
        expr = str(nums[0])
        for n in nums[1:]:
            expr += rng.choice(self.ops) + str(n)
        # Python's precedence is the usual one; the expression holds only ints and + - *.
        return expr, eval(expr, {"__builtins__": {}})  # noqa: S307

    def _item(self, expr: str, value: int, idx: str) -> TaskItem:
        return TaskItem(id=idx, prompt=self.template.format(expr=expr), answer=str(value), meta={"expr": expr})

    def train_items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        rng = random.Random(f"arith-train-{seed}")
        i = 0
        while True:
            expr, value = self._make(rng)
            if _is_eval(expr, self.eval_share):
                continue
            if i >= start:
                yield self._item(expr, value, f"train-{seed}-{i}")
            i += 1

    def eval_items(self, n: int) -> list[TaskItem]:
        rng = random.Random("arith-eval")
        out: list[TaskItem] = []
        seen: set[str] = set()
        for _ in range(1000 * n):
            if len(out) == n:
                break
            expr, value = self._make(rng)
            if expr in seen or not _is_eval(expr, self.eval_share):
                continue
            seen.add(expr)
            out.append(self._item(expr, value, f"eval-{len(out)}"))
        return out

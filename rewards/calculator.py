"""The calculator environment: sums and products too long to do in the head, and a `calc` tool.

An item is an expression such as `482*371+905`; the model may call `calc` (any number of times, up to
`max_turns - 1`) and then answers with the number. The tool is the way to be right: the embedded model
gets essentially none of these by itself. Held-out expressions are split off by a hash, as for the
arithmetic task, so evaluation never sees a training item.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Iterator

from rewards.arithmetic import _is_eval, digits_match, final_integer, format_ok
from rewards.base import TaskItem
from rewards.environment import Message, Rubric, ToolEnv

MAX_EXPR = 64  # characters of an expression the tool evaluates
MAX_VALUE = 10**30
SYSTEM = ("You have a calculator: call calc(expr) for any arithmetic (+, -, *, parentheses). When you have "
          "the result, answer with just the number.")


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
        a, b = _value(node.left), _value(node.right)
        v = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        if abs(v) > MAX_VALUE:
            raise ValueError("result too large")
        return v
    raise ValueError("only integers, + - * and parentheses")


def calc(expr: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expr: integers with + - * and parentheses, e.g. 12*(3+4)
    """
    if len(expr) > MAX_EXPR:
        raise ValueError(f"expression longer than {MAX_EXPR} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None
    return str(_value(tree))


def correct_answer(text: str, answer: str) -> float:
    """1 when the last turn's final integer is the expression's value."""
    value = final_integer(text)
    return 1.0 if value is not None and str(value) == answer else 0.0


def digits_reward(item: TaskItem, text: str) -> float:
    """Partial credit: the share of the answer's digit places that the last turn gets right."""
    return digits_match(item, text)


def answer_format(item: TaskItem, text: str) -> float:
    """1 when the last turn is just a number."""
    return format_ok(item, text)


class CalculatorEnv(ToolEnv):
    def __init__(self, digits: int = 3, ops: str = "+*", terms: int = 3, eval_share: float = 0.1,
                 max_turns: int = 2, tool_format: str = "pythonic", system_prompt: str | None = None,
                 correct_weight: float = 1.0, digits_weight: float = 0.5, format_weight: float = 0.1):
        if not 1 <= digits <= 6 or not 2 <= terms <= 4 or not set(ops) <= set("+-*") or not ops:
            raise ValueError("calculator: digits in 1..6, terms in 2..4, ops a subset of '+-*'")
        if max_turns < 2:
            raise ValueError("calculator: max_turns >= 2 (a call, then the answer)")
        params = {"digits": digits, "ops": ops, "terms": terms, "eval_share": eval_share, "max_turns": max_turns,
                  "tool_format": tool_format, "system_prompt": system_prompt}
        rubric = Rubric([("correct", correct_answer, correct_weight), ("digits", digits_reward, digits_weight),
                         ("format", answer_format, format_weight)])
        super().__init__("calculator", [calc], rubric, max_turns, params, tool_format, system_prompt)
        self.digits, self.ops, self.terms, self.eval_share = digits, ops, terms, eval_share

    def _make(self, rng: random.Random) -> tuple[str, int]:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        expr = str(rng.randint(lo, hi))
        for _ in range(self.terms - 1):
            expr += rng.choice(self.ops) + str(rng.randint(lo, hi))
        return expr, int(calc(expr))

    def _item(self, expr: str, value: int, idx: str) -> TaskItem:
        return TaskItem(id=idx, prompt=expr, answer=str(value), meta={"expr": expr})

    def train_items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        rng = random.Random(f"calc-train-{seed}")
        i = 0
        while True:
            expr, value = self._make(rng)
            if _is_eval(expr, self.eval_share):
                continue
            if i >= start:
                yield self._item(expr, value, f"train-{seed}-{i}")
            i += 1

    def eval_items(self, n: int) -> list[TaskItem]:
        rng = random.Random("calc-eval")
        out, seen = [], set()
        for _ in range(1000 * n):
            if len(out) == n:
                break
            expr, value = self._make(rng)
            if expr in seen or not _is_eval(expr, self.eval_share):
                continue
            seen.add(expr)
            out.append(self._item(expr, value, f"eval-{len(out)}"))
        return out

    def demonstration(self, item: TaskItem) -> list[Message]:
        expr = item.meta["expr"]
        return [{"role": "assistant", "content": self.write_call("calc", positional=True, expr=expr)},
                {"role": "tool", "name": "calc", "content": calc(expr)},
                {"role": "assistant", "content": calc(expr)}]

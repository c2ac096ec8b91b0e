"""A Python tool: the model writes code, the sandbox runs it (rewards/sandbox.py), the model reads its output.

Items are small computations that are easy to write and tedious to do by hand (sums of multiples, prime
counts, modular powers, digit sums of powers); the answer is an integer, checked like the calculator's.
The tool's result is the program's stdout (stripped, at most MAX_TOOL_RESULT characters), or "error: ..."
with the exception's last line, or the limit it hit: the same text wherever it runs, so the trainer's
replay, in its own sandbox, gives what an honest node saw. The interpreter is Debian's Python, so the
environment names its version and a node with another one does not take the work (`python` param).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from rewards.arithmetic import digits_match, final_integer
from rewards.base import TaskItem
from rewards.environment import MAX_TOOL_RESULT, Message, Rubric, ToolEnv
from rewards.sandbox import Limits, SandboxUnavailable, clamp, interpreter_version, run_python
from rewards.tools import ToolCall

SYSTEM = ("You can run Python: call python(code) and read what it prints. When you have the result, answer "
          "with just the number.")


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints.

    Args:
        code: a complete program; print the result
    """
    raise RuntimeError("run by PythonEnv.run_tool in the sandbox")  # the schema's source only


def _primes_below(n: int) -> int:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"[:n]
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return sum(sieve)


# family -> (question, code a good answer runs, the answer)
def _problem(rng: random.Random) -> tuple[str, str, int]:
    kind = rng.randrange(4)
    if kind == 0:
        k, n = rng.randint(3, 19), rng.randint(100, 5000)
        return (f"sum of multiples of {k} below {n}", f"print(sum(range(0, {n}, {k})))", sum(range(0, n, k)))
    if kind == 1:
        n = rng.randint(50, 5000)
        code = f"print(sum(all(i % d for d in range(2, int(i**.5) + 1)) for i in range(2, {n})))"
        return (f"number of primes below {n}", code, _primes_below(n))
    if kind == 2:
        a, b, m = rng.randint(2, 99), rng.randint(10, 999), rng.randint(7, 9999)
        return (f"{a}**{b} mod {m}", f"print(pow({a}, {b}, {m}))", pow(a, b, m))
    a, b = rng.randint(2, 9), rng.randint(10, 99)
    return (f"digit sum of {a}**{b}", f"print(sum(map(int, str({a}**{b}))))", sum(map(int, str(a**b))))


def correct_answer(text: str, answer: str) -> float:
    value = final_integer(text)
    return 1.0 if value is not None and str(value) == answer else 0.0


def digits_reward(item: TaskItem, text: str) -> float:
    return digits_match(item, text)


class PythonEnv(ToolEnv):
    def __init__(self, eval_share: float = 0.1, max_turns: int = 3, tool_format: str = "pythonic",
                 system_prompt: str | None = None, limits: dict | None = None, python: str = ""):
        """`python`: the sandbox interpreter's version the run expects (default: this machine's); a node
        whose sandbox runs another one refuses the work rather than answer with other outputs."""
        # Per call: a second of CPU, three of wall clock (the sandbox's other limits are its defaults).
        self.limits = clamp(Limits(**{"cpu_s": 1, "wall_s": 3.0, **(limits or {})}))
        local = interpreter_version()
        python = python or local
        if python != local:
            raise SandboxUnavailable(f"the run's python tool uses Python {python}; this sandbox has {local}")
        params = {"eval_share": eval_share, "max_turns": max_turns, "tool_format": tool_format,
                  "system_prompt": system_prompt, "limits": limits or {}, "python": python}
        rubric = Rubric([("correct", correct_answer, 1.0), ("digits", digits_reward, 0.5)])
        super().__init__("python", [globals()["python"]], rubric, max_turns, params, tool_format, system_prompt)
        self.eval_share, self.python_version = eval_share, python
        # A program's output, by its text: a run that exits is a pure function of the program (that is the
        # environment's contract), and a group's episodes often write the same one; a run costs its program's
        # time and ~1.5 ms more (rewards/sandbox.py). Runs stopped by a limit depend on timing: never kept.
        self.results: dict[str, tuple[str, bool]] = {}

    def run_tool(self, call: ToolCall) -> tuple[str, bool]:
        if call.name != "python" or set(call.arguments) != {"code"} or not isinstance(call.arguments["code"], str):
            return super().run_tool(call)  # the schema's error message
        code = call.arguments["code"]
        if (kept := self.results.get(code)) is not None:
            return kept
        r = run_python(code, self.limits)
        if r.status not in ("ok", "error"):
            return f"error: {r.status.replace('_', ' ')}", False
        out = ((r.stdout.strip() or "(no output)")[:MAX_TOOL_RESULT], True) if r.status == "ok" else \
            (f"error: {r.stderr_tail}"[:MAX_TOOL_RESULT], False)
        if len(code) <= 4 * MAX_TOOL_RESULT:
            if len(self.results) >= 4096:  # bounded: a node or trainer runs for days
                self.results.clear()
            self.results[code] = out
        return out

    node_meta = ()  # the reference program is for the warm-up only: nodes get the question alone

    def _item(self, q: str, code: str, value: int, idx: str) -> TaskItem:
        return TaskItem(id=idx, prompt=q, answer=str(value), meta={"code": code})

    def _is_eval(self, q: str) -> bool:
        return int.from_bytes(hashlib.sha256(q.encode()).digest()[:8], "big") / 2**64 < self.eval_share

    def train_items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        rng = random.Random(f"python-train-{seed}")
        i = 0
        while True:
            q, code, value = _problem(rng)
            if self._is_eval(q):
                continue
            if i >= start:
                yield self._item(q, code, value, f"train-{seed}-{i}")
            i += 1

    def eval_items(self, n: int) -> list[TaskItem]:
        rng = random.Random("python-eval")
        out, seen = [], set()
        for _ in range(1000 * n):
            if len(out) == n:
                break
            q, code, value = _problem(rng)
            if q in seen or not self._is_eval(q):
                continue
            seen.add(q)
            out.append(self._item(q, code, value, f"eval-{len(out)}"))
        return out

    def demonstration(self, item: TaskItem) -> list[Message]:
        result, _ = self.run_tool(ToolCall("python", {"code": item.meta["code"]}))
        return [{"role": "assistant", "content": self.write_call("python", positional=True, code=item.meta["code"])},
                {"role": "tool", "name": "python", "content": result},
                {"role": "assistant", "content": result}]

"""Guess the number: a game with feedback, rewarded by the turns it takes.

An item is a range `lo..hi` and a secret in it. Each turn the model guesses a number; the environment
answers "higher" or "lower" (a user message) until the guess is right or `max_turns` are spent. The
reward is 1 for a first-turn hit, falling by 1/max_turns per extra turn, 0 when never found; accuracy is
"found within max_turns". Halving the range each turn finds any secret of a 32-wide range in 5 turns.

The warm-up's demonstrations play by the rules but not well: each guess is drawn at random from the range
the feedback so far leaves open (seeded by the item), so RL has the strategy to learn.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator

from rewards.base import TaskItem
from rewards.environment import Environment, Message, Rubric, State, assistant_texts

_INT = re.compile(r"-?\d{1,9}")
SYSTEM = ("I am thinking of a whole number in the range I give you. Guess it: reply with just a number, and "
          "I will say higher or lower.")


def guess_of(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def found(messages: list[Message], item: TaskItem) -> bool:
    texts = assistant_texts(messages)
    return bool(texts) and guess_of(texts[-1]) == int(item.meta["secret"])


class GuessEnv(Environment):
    def __init__(self, width: int = 32, starts: int = 100, max_turns: int = 6, eval_share: float = 0.15,
                 system_prompt: str | None = None, turns_weight: float = 1.0, found_weight: float = 0.0,
                 valid_weight: float = 0.1):
        if not 2 <= width <= 10**6 or not 1 <= starts <= 10**6 or not 1 <= max_turns <= 32:
            raise ValueError("guess: width in 2..1e6, starts in 1..1e6, max_turns in 1..32")
        params = {"width": width, "starts": starts, "max_turns": max_turns, "eval_share": eval_share,
                  "system_prompt": system_prompt}

        def by_turns(messages: list[Message], item: TaskItem) -> float:
            """1 for a first-turn hit, 1/max_turns less per extra turn, 0 if never found."""
            turns = len(assistant_texts(messages))
            return (max_turns - turns + 1) / max_turns if found(messages, item) else 0.0

        def correct(messages: list[Message], item: TaskItem) -> float:
            """Found within max_turns: the accuracy metric."""
            return float(found(messages, item))

        def valid(messages: list[Message], item: TaskItem) -> float:
            """The share of guesses that are numbers inside the range still open."""
            lo, hi = int(item.meta["lo"]), int(item.meta["hi"])
            texts, ok = assistant_texts(messages), 0
            for t in texts:
                g = guess_of(t)
                if g is not None and lo <= g <= hi:
                    ok += 1
                    secret = int(item.meta["secret"])
                    lo, hi = (g + 1, hi) if g < secret else (lo, g - 1) if g > secret else (g, g)
            return ok / len(texts) if texts else 0.0

        rubric = Rubric([("turns", by_turns, turns_weight), ("correct", correct, found_weight),
                         ("valid", valid, valid_weight)])
        super().__init__("guess", rubric, max_turns, params, system_prompt)
        self.width, self.starts, self.eval_share = width, starts, eval_share

    def is_completed(self, messages: list[Message], state: State) -> bool:
        return guess_of(messages[-1]["content"]) == state["secret"]

    def setup_state(self, item: TaskItem) -> State:
        return {"secret": int(item.meta["secret"])}

    def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], State]:
        g = guess_of(messages[-1]["content"])
        reply = "a number, please" if g is None else "higher" if g < state["secret"] else "lower"
        return [{"role": "user", "content": reply}], state

    # ---- items ------------------------------------------------------------------------------------

    def _item(self, lo: int, secret: int, idx: str) -> TaskItem:
        hi = lo + self.width - 1
        return TaskItem(id=idx, prompt=f"{lo}..{hi}", answer=str(secret),
                        meta={"lo": str(lo), "hi": str(hi), "secret": str(secret)})

    def _is_eval(self, lo: int, secret: int) -> bool:
        h = int.from_bytes(hashlib.sha256(f"guess|{lo}|{secret}".encode()).digest()[:8], "big")
        return h / 2**64 < self.eval_share

    def train_items(self, seed: int, start: int = 0) -> Iterator[TaskItem]:
        rng = random.Random(f"guess-train-{seed}")
        i = 0
        while True:
            lo = rng.randrange(self.starts)
            secret = lo + rng.randrange(self.width)
            if self._is_eval(lo, secret):
                continue
            if i >= start:
                yield self._item(lo, secret, f"train-{seed}-{i}")
            i += 1

    def eval_items(self, n: int) -> list[TaskItem]:
        rng = random.Random("guess-eval")
        out, seen = [], set()
        for _ in range(1000 * n):
            if len(out) == n:
                break
            lo = rng.randrange(self.starts)
            secret = lo + rng.randrange(self.width)
            if (lo, secret) in seen or not self._is_eval(lo, secret):
                continue
            seen.add((lo, secret))
            out.append(self._item(lo, secret, f"eval-{len(out)}"))
        return out

    def demonstration(self, item: TaskItem) -> list[Message]:
        """Guesses drawn at random from the range still open (seeded by the item), until found."""
        rng = random.Random(f"guess-demo-{item.id}-{item.prompt}")
        lo, hi, secret = int(item.meta["lo"]), int(item.meta["hi"]), int(item.meta["secret"])
        out: list[Message] = []
        for turn in range(self.max_turns):
            g = rng.randint(lo, hi)
            out.append({"role": "assistant", "content": str(g)})
            if g == secret or turn == self.max_turns - 1:
                break
            out.append({"role": "user", "content": "higher" if g < secret else "lower"})
            lo, hi = (g + 1, hi) if g < secret else (lo, g - 1)
        return out

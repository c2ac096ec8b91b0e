"""The trainer's own reference for the paired test: it samples a newcomer's prompt itself, same policy.

A key on probation is released once its rewards on shared prompts are shown to be no better than a
reference's (trainer/pairing.py). Without an established or trusted node live there is no reference and
strangers wait for good. With `guard.reference` on, the trainer is that reference: for each group a key on
probation delivers, it draws G samples of the same prompt with the very weights the node claims to have
used (the audit keeps them), the same sampling settings, and scores them with the same rubric. The
comparison is as like-with-like as it gets (same prompt, same policy version), and needs no second machine.

It costs the trainer's compute, so it runs within a budget: at most `guard.reference_budget` of the
wall-clock time of one thread (a token bucket of seconds), one group at a time, newest first; groups
waiting past the audit's window of versions are let go (the key's later groups get their turn).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.audit import Auditor
from trainer.intake import Group

log = logging.getLogger(__name__)

BURST_S = 5.0  # seconds of sampling the budget lets pile up while nobody is on probation
QUEUE = 256  # groups waiting for a reference at most (the oldest go first)


@dataclass
class Drawn:
    """The reference's answer to one group's prompt."""

    group: Group
    rewards: list[float]
    seconds: float


class Reference:
    def __init__(self, auditor: Auditor, score: Callable[[Group, list[list[int]]], list[float]], group_size: int,
                 max_tokens: int, eos_id: int, pad_id: int, budget: float):
        self.auditor, self.score = auditor, score
        self.group_size, self.max_tokens, self.eos_id, self.pad_id = group_size, max_tokens, eos_id, pad_id
        self.budget = budget  # share of one thread's time the reference may take
        self.queue: collections.deque[Group] = collections.deque(maxlen=QUEUE)
        self.ready = asyncio.Event()
        self.tokens = BURST_S  # seconds of sampling allowed now
        self.last = time.monotonic()
        self.groups = 0  # groups sampled
        self.seconds = 0.0  # time spent sampling

    def request(self, groups: list[Group]) -> None:
        """A key on probation delivered these: sample their prompts when the budget allows."""
        self.queue.extend(groups)
        self.ready.set()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(BURST_S, self.tokens + (now - self.last) * self.budget)
        self.last = now

    async def run(self, wanted: Callable[[Group], bool], done: Callable[[Drawn], None]) -> None:
        """Sample queued groups forever, newest first, within the budget. `wanted(group)`: still worth a
        reference (its key is still on probation, its version still in the audit's window); `done` gets
        each answer."""
        while True:
            while not self.queue:
                self.ready.clear()
                await self.ready.wait()
            self._refill()
            if self.tokens <= 0:
                await asyncio.sleep(-self.tokens / self.budget)
                continue
            group = self.queue.pop()
            if not wanted(group):
                continue
            t0 = time.perf_counter()
            try:
                completions = await asyncio.to_thread(self.sample, group.prompt_ids, group.version)
            except Exception:
                log.exception("the reference could not sample %s", group.assignment_id)
                continue
            spent = time.perf_counter() - t0
            self._refill()
            self.tokens -= spent
            if completions is None:
                continue  # the version left the audit's window meanwhile
            self.groups += 1
            self.seconds += spent
            done(Drawn(group, self.score(group, completions), spent))

    @torch.no_grad()
    def sample(self, prompt_ids: list[int], version: int) -> list[list[int]] | None:
        """G completions of the prompt with version `version`'s published weights (None: not kept any more),
        as a node samples them: temperature and top-p of the run, up to max_tokens, ending at the stop token."""
        a = self.auditor
        with a.lock:
            model = a.load(version)
            if model is None:
                return None
            ids = torch.tensor([prompt_ids] * self.group_size)
            sampling = dict(do_sample=True, temperature=a.temperature, top_p=a.top_p, top_k=0) \
                if a.temperature > 0 else dict(do_sample=False)  # temperature 0: the nodes decode greedily
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **sampling,
                                 max_new_tokens=self.max_tokens, eos_token_id=self.eos_id,
                                 pad_token_id=self.pad_id)
        completions = []
        for row in out[:, len(prompt_ids):].tolist():
            completions.append(row[: row.index(self.eos_id) + 1] if self.eos_id in row else row[: self.max_tokens])
        return completions

"""Accepted groups waiting for the learner, oldest first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from trainer.intake import Group


class BatchBuffer:
    def __init__(self):
        self.groups: list[Group] = []
        self.changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, groups: list[Group]) -> None:
        if groups:
            self.groups.extend(groups)
            self.changed.set()

    async def take(self, n: int, floor: Callable[[], int], on_stale: Callable[[list[Group]], None]) -> list[Group]:
        """Wait for n groups from version floor() or newer; older ones are handed to `on_stale` and dropped."""
        while True:
            oldest = floor()
            stale = [g for g in self.groups if g.version < oldest]
            if stale:
                self.groups = [g for g in self.groups if g.version >= oldest]
                on_stale(stale)
            if len(self.groups) >= n:
                batch, self.groups = self.groups[:n], self.groups[n:]
                return batch
            self.changed.clear()
            await self.changed.wait()

    def remove(self, pred: Callable[[Group], bool]) -> list[Group]:
        out = [g for g in self.groups if pred(g)]
        if out:
            self.groups = [g for g in self.groups if not pred(g)]
        return out

    def drain(self) -> list[Group]:
        out, self.groups = self.groups, []
        return out

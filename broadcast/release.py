"""The origin sends a version's pieces about in index order, which splits its uplink evenly between trees."""

from __future__ import annotations

import asyncio


class InOrderRelease:
    """Piece i may be sent once every piece below i - window has been sent at least once.

    Piece i travels down tree i mod k, so this gives each tree an even share of the origin's uplink whatever
    TCP makes of the k flows that share it. A tree given less stays behind to the end (every relay below
    forwards exactly what it receives: no slack to catch up), one given more piles up at its first relay.
    `max_wait` bounds the hold, so a piece nobody asks for (a child that already had it) stalls nothing.
    """

    def __init__(self, n_pieces: int, window: int, max_wait: float = 2.0):
        self.sent = bytearray(n_pieces)
        self.frontier = 0  # every piece below it has been sent
        self.window = max(1, window)
        self.max_wait = max_wait
        self._moved = asyncio.Condition()

    async def wait_turn(self, index: int) -> None:
        if index < self.frontier + self.window:
            return
        try:
            async with asyncio.timeout(self.max_wait), self._moved:
                await self._moved.wait_for(lambda: index < self.frontier + self.window)
        except TimeoutError:
            # Pieces below nobody is sending (children that had them, a child gone): stop waiting on them.
            self.frontier = max(self.frontier, index)

    async def sent_one(self, index: int) -> None:
        self.sent[index] = 1
        moved = False
        while self.frontier < len(self.sent) and self.sent[self.frontier]:
            self.frontier += 1
            moved = True
        if moved:
            async with self._moved:
                self._moved.notify_all()

"""InOrderRelease: the origin holds a piece far ahead of the lowest unsent one, for a bounded time."""

from __future__ import annotations

import asyncio
import time

from broadcast.release import InOrderRelease


def test_a_piece_ahead_of_the_window_waits_for_the_frontier():
    async def scenario() -> None:
        r = InOrderRelease(n_pieces=20, window=4, max_wait=5.0)
        await r.wait_turn(3)  # inside the window: at once
        ahead = asyncio.create_task(r.wait_turn(6))
        await asyncio.sleep(0.05)
        assert not ahead.done(), "piece 6 is held while pieces 0..2 are unsent"
        for i in (1, 2, 0):
            await r.sent_one(i)
        await asyncio.wait_for(ahead, 1)
        assert r.frontier == 3

    asyncio.run(scenario())


def test_a_piece_nobody_sends_stalls_the_rest_once_only():
    async def scenario() -> None:
        r = InOrderRelease(n_pieces=100, window=4, max_wait=0.2)
        t0 = time.monotonic()
        await r.wait_turn(50)  # piece 0.. never asked for (a child that had them): released after max_wait
        assert 0.15 < time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        await r.wait_turn(51)  # and the frontier moved past them, so the next one is not held again
        assert time.monotonic() - t0 < 0.15  # held again would be max_wait (0.2 s); slack for a loaded CI

    asyncio.run(scenario())


def test_auto_piece_size_keeps_a_few_hundred_pieces(tmp_path):
    from broadcast.manifest import auto_piece_size

    (tmp_path / "a.bin").write_bytes(b"\0" * (8 << 20))
    assert auto_piece_size(tmp_path) == 32 << 10  # 256 pieces
    (tmp_path / "b.bin").write_bytes(b"\0" * (40 << 20))
    assert auto_piece_size(tmp_path) == 128 << 10  # 48 MiB: 384 pieces

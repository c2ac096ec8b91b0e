"""A child's requests to one source take turns per tree (broadcast/serving.py, Turns): its window of
requests keeps the pipe full without splitting its share of the uplink, so each piece reaches it in one
piece time, not `window` of them. Over real HTTP against the real origin, its uplink limited."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from bc_helpers import make_version

import broadcast.serving as serving
from broadcast.config import OriginConfig
from broadcast.messages import Join
from broadcast.origin import Origin
from broadcast.piece_pass import headers, piece_name
from broadcast.turns import turn_key
from swarm_common.keys import KeyPair

pytestmark = pytest.mark.timeout(60)
RATE = 1 << 20  # the origin's uplink, bytes/s
PIECE = 256 << 10


async def fetch_all(tmp_path, requests: list[tuple[str, int]]) -> list[float]:
    """Ask the origin for each (X-Peer, piece) at once; the seconds until each body's last byte."""
    o = Origin(tmp_path / "origin", KeyPair.generate(), OriginConfig(trees=4, upload_rate=RATE, piece_bytes=PIECE))
    await o.start()
    try:
        await o.publish(make_version(tmp_path / "origin" / "v1", 1, 1 << 20), 1, None)
        assert o.tracker
        members = {c: o.tracker.join(Join(None, False, c), key=c * 64) for c, _ in requests}  # members only
        async with aiohttp.ClientSession() as s:

            async def one(child: str, i: int) -> float:
                j = members[child]
                async with s.get(f"{o.url}/v/1/piece/{i}", headers=headers(j.peer_id, j.token, piece_name(1, i))) as r:
                    assert r.status == 200
                    assert len(await r.read()) == PIECE
                return time.monotonic() - t0

            t0 = time.monotonic()
            return list(await asyncio.gather(*(one(c, i) for c, i in requests)))
    finally:
        await o.stop()


def test_a_childs_window_on_one_tree_is_sent_a_piece_at_a_time(tmp_path):
    """Pieces 0 and 4 (tree 0 of 4) for one child: the first is whole after one piece time (0.25 s at
    1 MiB/s), not after two as when both shared the uplink."""
    first, second = asyncio.run(fetch_all(tmp_path, [("a", 0), ("a", 4)]))
    assert second >= 2 * PIECE / RATE * 0.9
    assert first < 0.7 * second, (first, second)


def test_other_trees_and_other_children_are_not_kept_waiting(tmp_path):
    """Different trees of one child, and the same tree of two children, share the uplink as before."""
    a0, a1, b0 = asyncio.run(fetch_all(tmp_path, [("a", 0), ("a", 1), ("b", 0)]))
    assert max(a0, a1, b0) < 1.3 * min(a0, a1, b0), (a0, a1, b0)


def test_a_turn_held_too_long_is_not_waited_for():
    """One who holds a child's turn (a slow reader, or someone claiming its name from its address) delays
    its next request by the bound at most; nothing is left behind once all are done."""
    turns = serving.Turns()

    async def main() -> float:
        release = asyncio.Event()

        async def holder() -> None:
            async with turns.turn("a", 0, 4, 0.2):
                await release.wait()

        task = asyncio.create_task(holder())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        async with turns.turn("a", 0, 4, 0.2):
            waited = time.monotonic() - t0
        release.set()
        await task
        assert not turns.queue.waiting(turn_key("a", 0, 4))
        return waited

    assert 0.15 < asyncio.run(main()) < 1.0

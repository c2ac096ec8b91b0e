"""A join flood from many addresses of one network (issue 29: 994 of 1,500 joins from many addresses were
accepted, the tracker was full, and a new honest node was refused for 12 s): joins are budgeted per /24 as
well as per address, and part of max_peers is kept for keys with standing, so the flood neither fills the
tracker for other networks nor keeps the trainer's established nodes out. Over real HTTP from distinct
loopback addresses, against the real origin."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest

from broadcast.config import OriginConfig
from broadcast.identity import sign_join
from broadcast.messages import Join
from broadcast.origin import Origin
from swarm_common.keys import KeyPair

pytestmark = pytest.mark.timeout(60)


def test_a_flood_from_one_prefix_leaves_room_for_other_networks_and_for_keys_with_standing(tmp_path):
    """Issue 29: joins from many addresses filled the tracker, and an honest node was refused. Now joins are
    budgeted per /24 as well as per address, and part of max_peers is kept for keys with standing."""

    async def join_from(origin: Origin, ip: str, key: KeyPair) -> int:
        conn = aiohttp.TCPConnector(local_addr=(ip, 0))
        async with aiohttp.ClientSession(connector=conn) as s, s.post(
                origin.url + "/join", data=msgspec.json.encode(sign_join(Join(None, False, ip), key))) as r:
            return r.status

    async def scenario():
        origin = Origin(tmp_path / "origin", KeyPair.generate(), OriginConfig(max_peers=20, joins_per_prefix=(0.1, 12.0)))
        await origin.start()
        try:
            flood = [await join_from(origin, f"127.0.0.{2 + i}", KeyPair.generate()) for i in range(40)]
            assert flood.count(200) == 12 and flood.count(429) == 28, flood  # the prefix's burst, then no more
            assert origin.tracker.refused["prefix_limited"] == 28
            others = [await join_from(origin, f"127.0.{1 + i}.9", KeyPair.generate()) for i in range(6)]
            assert others.count(200) == 4 and others.count(503) == 2  # 16 of 20 places for fresh keys, then full
            assert origin.tracker.refused["full_for_fresh_keys"] == 2
            node = KeyPair.generate()  # the trainer's established node, from the flooded network
            origin.set_standing(node.public_hex)
            assert await join_from(origin, "127.0.0.250", node) == 200
        finally:
            await origin.stop()

    asyncio.run(scenario())

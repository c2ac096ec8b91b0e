"""A helper (broadcast/sourcing.SourceBook.helper): a source that lately delivered us another tree's piece,
asked before the origin once a piece's relays are silent, for the piece only if it has it now. Over real
HTTP, with the real origin and two real peers: the helper serves what it holds and answers 404 at once for
what it does not (HOLD_HEADER), where a child's request is held until the piece arrives."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from bc_helpers import make_version

from broadcast.config import OriginConfig
from broadcast.messages import ORIGIN
from broadcast.origin import Origin
from broadcast.peer import Peer, PeerConfig
from broadcast.piece_pass import HOLD_HEADER, headers, piece_name
from swarm_common.keys import KeyPair

pytestmark = pytest.mark.timeout(60)


def test_a_helper_serves_what_it_holds_and_refuses_at_once_what_it_does_not(tmp_path):
    async def main() -> dict:
        key = KeyPair.generate()
        o = Origin(tmp_path / "origin", key, OriginConfig(heartbeat_s=0.3, piece_bytes=64 << 10))
        await o.start()
        await o.publish(make_version(tmp_path / "origin" / "v1", 1, 512 << 10), 1, None)
        helper = Peer(o.url, tmp_path / "h", key.public_bytes, PeerConfig(relay=True), follow=False)
        child = Peer(o.url, tmp_path / "c", key.public_bytes, PeerConfig(relay=False), follow=False)
        out: dict = {}
        try:
            await helper.start()
            await child.start()
            st = await asyncio.to_thread(helper.store.open_partial, await helper.downloads.manifest(1))
            helper.downloads.states[1] = st
            for i in range(4):  # the helper holds pieces 0-3 of 8
                assert await helper.fetcher.race(st, i, [ORIGIN]) == "ok"
            cst = await asyncio.to_thread(child.store.open_partial, await child.downloads.manifest(1))
            t0 = time.monotonic()
            out["held"] = await child.fetcher.race(cst, 2, [ORIGIN], helpers=[helper.url])
            out["held_from"] = dict(child.received)
            t1 = time.monotonic()
            out["missing"] = await child.fetcher.race(cst, 5, [ORIGIN], helpers=[helper.url])
            out["missing_s"], out["held_s"] = time.monotonic() - t1, t1 - t0
            out["from"] = dict(child.received)
            out["unhelpful"] = dict(child.book.unhelpful)
            out["served"] = helper.served_bytes
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=1.0)) as s:
                url, hdr = f"{helper.url}/v/1/piece/6", headers(child.peer_id, child.tracker.token, piece_name(1, 6))
                async with s.get(url, headers={**hdr, HOLD_HEADER: "0"}) as r:
                    out["no_hold_status"] = r.status
                async with s.get(url, headers=hdr) as r:  # a child's request: answered, then held
                    out["hold_status"] = r.status
                    try:
                        await r.read()
                        out["hold_read"] = "read"
                    except TimeoutError:
                        out["hold_read"] = "held"
        finally:
            await child.stop()
            await helper.stop()
            await o.stop()
        return out

    out = asyncio.run(main())
    piece = 64 << 10
    assert out["held"] == "ok" and list(out["held_from"].values()) == [piece] and ORIGIN not in out["held_from"]
    assert out["missing"] == "ok" and out["missing_s"] < 1.0  # refused at once: the origin sent it
    assert out["from"] == {**out["held_from"], ORIGIN: piece}
    assert out["unhelpful"] == {} and out["served"] == piece  # not here yet is no fault
    assert out["no_hold_status"] == 404 and out["hold_status"] == 200 and out["hold_read"] == "held"

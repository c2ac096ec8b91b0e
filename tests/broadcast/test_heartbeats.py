"""The tracker client's heartbeats over real HTTP: answers are read in the order the beats were sent."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgspec
import pytest
from aiohttp import web

from broadcast.config import PeerConfig
from broadcast.messages import TreeSources
from broadcast.tracker_client import Holdings, TrackerClient
from swarm_common.keys import KeyPair

pytestmark = pytest.mark.timeout(30)


def test_a_beat_beside_the_loop_never_reads_an_older_answer_as_a_malformed_assignment(caplog):
    """A download's start beats beside the heartbeat loop. The tracker answers "unchanged since tag T0" to
    the first beat and, having laid the tree out anew, new sources (T1) to the second; read the other way
    round, the first answer named a tag no longer held, and the peer logged "bad assignment from tracker:
    malformed sources" (seen across namespaces in the attack lab)."""
    with caplog.at_level(logging.WARNING, logger="broadcast"):
        tc, beats = asyncio.run(_two_beats())
    assert beats == 2
    assert "bad assignment" not in caplog.text
    assert tc.sources == [["http://10.0.0.9:7000"]] and tc.sources_tag == "T1"


async def _two_beats() -> tuple[TrackerClient, int]:
    beats = 0

    async def heartbeat(request: web.Request) -> web.Response:
        nonlocal beats
        beats += 1
        if beats == 1:
            await asyncio.sleep(0.3)  # the first answer is the slower one
            out = TreeSources(None, [], tag="T0")
        else:
            out = TreeSources(None, [["http://10.0.0.9:7000"]], tag="T1")
        return web.Response(body=msgspec.json.encode(out), content_type="application/json")

    app = web.Application()
    app.router.add_post("/heartbeat", heartbeat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    tc = TrackerClient(f"http://127.0.0.1:{port}", PeerConfig(), KeyPair.generate(), b"",
                       lambda: Holdings([], {}, 0), lambda v: None, lambda why: None)
    tc.peer_id, tc.token, tc.sources, tc.sources_tag = "p1", "t", [["http://10.0.0.8:7000"]], "T0"
    tc.session = aiohttp.ClientSession()
    try:
        await asyncio.gather(tc.heartbeat_once(), tc.heartbeat_once())
    finally:
        await tc.session.close()
        await runner.cleanup()
    return tc, beats

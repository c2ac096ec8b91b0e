"""A response body arriving in several pieces is read whole (across real networks it does; on loopback
the first read usually returns all of it, which hid a truncated-manifest bug)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from swarm_common.http import read_capped, start_site


def test_read_capped_reads_a_body_sent_in_parts_and_stops_past_the_cap():
    body = bytes(range(256)) * 200  # 51200 bytes

    async def slow(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(0, len(body), 10000):
            await resp.write(body[i:i + 10000])
            await asyncio.sleep(0.05)  # the client's first read sees only the first part
        await resp.write_eof()
        return resp

    async def scenario() -> None:
        app = web.Application()
        app.add_routes([web.get("/", slow)])
        runner, port = await start_site(app, "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/") as r:
                    first = await r.content.read(1 << 20)
                    assert len(first) < len(body), "the premise: a plain read returns a part"
                async with s.get(f"http://127.0.0.1:{port}/") as r:
                    assert await read_capped(r.content, 1 << 20) == body
                async with s.get(f"http://127.0.0.1:{port}/") as r:
                    assert await read_capped(r.content, 25000) == body[:25001]
        finally:
            await runner.cleanup()

    asyncio.run(scenario())

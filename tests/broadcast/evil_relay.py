"""A relay that flips a byte in every piece it serves: the tree must catch, bypass and ban it."""

from __future__ import annotations

import argparse
import asyncio
import logging

from aiohttp import web

from broadcast import relay_main
from broadcast.peer import Peer


class EvilPeer(Peer):
    async def _piece(self, request: web.Request) -> web.StreamResponse:
        st = await self._lookup(int(request.match_info["version"]))
        index = int(request.match_info["index"])
        if st is None or not await st.wait_piece(index, 3):
            raise web.HTTPNotFound()
        data = bytearray(b"".join(st.read_chunks(index)))
        data[len(data) // 2] ^= 0xFF
        return web.Response(body=bytes(data))


if __name__ == "__main__":
    relay_main.Peer = EvilPeer  # run() builds its peer from this name
    p = argparse.ArgumentParser()
    relay_main.add_arguments(p)
    logging.basicConfig(level="INFO")
    raise SystemExit(asyncio.run(relay_main.run(p.parse_args())))

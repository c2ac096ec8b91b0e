"""A relay that flips a byte in every piece it serves: the tree must catch, bypass and ban it.

EVIL_FROM_VERSION=N in the environment: serve versions below N honestly, corrupt from N on."""

from __future__ import annotations

import logging
import os
import sys

from aiohttp import web

from broadcast import peer
from broadcast.relay_server import RelayServer
from swarm.cli import main


class EvilServer(RelayServer):
    async def _piece(self, request: web.Request) -> web.StreamResponse:
        st = await self.downloads.lookup(int(request.match_info["version"]), True)
        index = int(request.match_info["index"])
        if st is None or not await st.wait_piece(index, 3):
            raise web.HTTPNotFound()
        data = bytearray(b"".join(st.read_chunks(index)))
        if st.version >= int(os.environ.get("EVIL_FROM_VERSION", "0")):
            data[len(data) // 2] ^= 0xFF
        return web.Response(body=bytes(data))


if __name__ == "__main__":
    peer.RelayServer = EvilServer  # the peer builds its listener from this name
    logging.basicConfig(level="INFO")
    raise SystemExit(main(["relay", *sys.argv[1:]]))

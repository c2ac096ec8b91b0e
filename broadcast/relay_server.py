"""A peer's listener: what its children, the tracker and the origin ask of it.

GET /v/N/piece/I (verified pieces, held until on their way here arrive; serving.py), /v/N/manifest (the
signed manifest of a version held here), /reach (the tracker's connect-back: our key signs its nonce),
/probe (the origin's uplink probe, uplink_probe.py) and /health.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from swarm_common.keys import KeyPair

from .config import PeerConfig
from .downloads import Downloads
from .identity import is_hex, reach_answer
from .manifest import encode_manifest
from .piece_pass import HOLD_HEADER
from .ratelimit import RateLimiter
from .serving import MAX_VERSION, Turns, parse_int, serve_piece
from .tracker_client import TrackerClient
from .uplink_probe import PROBE_PATH, ProbeServer
from .uplink_share import FirstAnswer, UplinkShare


class RelayServer:
    def __init__(self, cfg: PeerConfig, keypair: KeyPair, tracker: TrackerClient, downloads: Downloads,
                 follow: Callable[[], bool]):
        self.cfg, self.keypair, self.tracker, self.downloads, self.follow = cfg, keypair, tracker, downloads, follow
        self.limiter = RateLimiter(cfg.upload_rate)
        self.turns = Turns()  # a child's requests take turns (serving.py)
        self.served_bytes = 0
        self.probe = ProbeServer(self.limiter, lambda: tracker.token)
        self.share = UplinkShare(time.monotonic)  # children with standing are sent to first

    def app(self) -> web.Application:
        app = web.Application(client_max_size=4096)
        app.add_routes([
            web.get("/health", self._health),
            web.get("/reach", self._reach),
            web.get(PROBE_PATH, self.probe.handle),  # the tracker's
            web.get("/v/{version}/manifest", self._manifest),
            web.get("/v/{version}/piece/{index}", self._piece),
        ])
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "versions": self.downloads.complete_versions()})

    async def _reach(self, request: web.Request) -> web.Response:
        """The tracker's connect-back: sign its nonce, so it knows this address answers for our key."""
        nonce = request.query.get("nonce", "")
        if not is_hex(nonce, 16, 64):
            raise web.HTTPBadRequest(text="nonce must be 16-64 hex digits")
        return web.Response(body=msgspec.json.encode(reach_answer(nonce, self.keypair)),
                            content_type="application/json")

    async def _manifest(self, request: web.Request) -> web.Response:
        """The signed manifest of a version held here: children need not all ask the origin for it."""
        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        st = None if self.tracker.evicted else await self.downloads.lookup(version, self.follow())
        if st is None:
            raise web.HTTPNotFound(text=f"version {version} not held here")
        return web.Response(body=encode_manifest(st.manifest), content_type="application/json")

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        if self.tracker.evicted:
            raise web.HTTPNotFound(text="evicted")

        async def lookup(version: int):
            return await self.downloads.lookup(version, self.follow())

        # The tracker names the members below us that are not first in line, by address (uplink_share.py); a
        # helper's request (HOLD_HEADER: a member not placed to ask us this piece) is not first either.
        remote = request.remote or ""
        if remote not in self.tracker.low and request.headers.get(HOLD_HEADER) != "0":
            first = FirstAnswer(self.share, f"{remote} {request.headers.get('X-Peer', '')[:64]}", self._sent)
            try:
                return await serve_piece(request, lookup, self.limiter, self.cfg.hold_s, self.turns,
                                         self.tracker.trees, first)
            finally:
                first.done()
        return await serve_piece(request, lookup, self.limiter, self.cfg.hold_s, self.turns, self.tracker.trees,
                                 None, self._pace_low)

    def _sent(self, n: int) -> None:
        self.served_bytes += n

    def _pace_low(self, n: int) -> float:
        self.served_bytes += n
        return self.share.low_sent(n)

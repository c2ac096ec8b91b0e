"""The origin: the tree's tracker and root seed in one aiohttp app, embeddable in the trainer's own event
loop. This file publishes versions (hashed, signed, as deltas or whole; the newest `keep` served) and runs
the tracker's clockwork (reaping, re-checks, the judge's and the uplink prober's tasks); its HTTP routes are
origin_routes.py's."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from swarm_common.atomic import write_atomic
from swarm_common.http import start_site
from swarm_common.keys import KeyPair

from .config import OriginConfig
from .delta_publish import build_version, want_delta
from .judge import Judge, Prober
from .manifest import Manifest, auto_piece_size
from .origin_routes import OriginRoutes
from .ratelimit import RateLimiter
from .release import InOrderRelease
from .serving import Turns
from .store import VersionState
from .tracker import Tracker
from .uplink_probe import UPLINKS_FILE, UplinkProber
from .uplink_share import UplinkShare

log = logging.getLogger("broadcast.origin")


class Origin:
    def __init__(self, root_dir: Path | str, keypair: KeyPair, config: OriginConfig | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, keep: int = 3):
        """`config`: the tree's knobs (broadcast/config.py; the trainer's [server.tree]). `host`, `port`: where
        the origin and tracker listen. `keep`: versions served at once (the newest)."""
        cfg = self.cfg = config or OriginConfig()
        self.root_dir, self.keypair = Path(root_dir).resolve(), keypair
        self.host, self.port = host, port
        self.fanout, self.keep, self.trees = cfg.fanout, keep, cfg.n_trees
        self.limiter = RateLimiter(cfg.upload_rate)
        self.versions: dict[int, VersionState] = {}
        self.full_dirs: dict[int, Path] = {}  # each served version's files whole (the trainer's directory)
        self._since_full = 0  # versions since the last whole one
        self.latest: int | None = None
        self.tracker: Tracker | None = None
        self.on_ban: Callable[[str, str], None] | None = None  # confirmed corruption: (key hex, reason)
        self.judge: Judge | None = None
        self.prober: Prober | None = None
        self.uplinks: UplinkProber | None = None  # times relays' uplinks before any child has
        self.routes = OriginRoutes(self)
        self._trusted: set[str] = set()  # keys the trainer calls established, kept across tracker restarts
        self.new_version = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._checks: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._url: str | None = None
        self.closing = False
        self.order: dict[int, InOrderRelease] = {}  # per version: its pieces leave about in order
        self.turns = Turns()  # serving.py: a child's requests take turns
        self.share = UplinkShare(time.monotonic)  # members with standing are sent to first (uplink_share.py)

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("Origin not started")
        return self._url

    async def start(self) -> None:
        self.root_dir.mkdir(parents=True, exist_ok=True)
        # Short shutdown: long polls and held piece requests must not keep stop() waiting.
        self._runner, self.port = await start_site(self.routes.app(), self.host, self.port, shutdown_timeout=1.0)
        self._url = f"http://{self.host}:{self.port}"
        self.tracker = Tracker(self._url, self.trees, self.fanout, self.cfg.heartbeat_s, clock=time,
                               max_peers=self.cfg.max_peers, reserved_share=self.cfg.reserved_share)
        for key in self._trusted:
            self.tracker.set_trusted(key)
        self.tracker.uploads.restore(self.root_dir / UPLINKS_FILE)  # a restarted trainer's swarm: no re-probing
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                              connector=aiohttp.TCPConnector(limit=64, force_close=True))
        # Piece checks from a session like a peer's (kept alive: force_close would add 'Connection: close',
        # which tells a relay the request is the origin's; piece_pass.py).
        self._checks = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                             connector=aiohttp.TCPConnector(limit=64))
        self.prober = Prober(self._session, self._checks)
        self.judge = Judge(self.tracker, self.prober, lambda: self.versions, self._banned_here)
        self.uplinks = UplinkProber(self.tracker, self._session, self.judge.spawn)
        self._tasks.append(asyncio.create_task(self._reaper()))
        log.info("origin at %s, trainer key %s, %d trees, fanout %d", self._url, self.keypair.fingerprint,
                 self.trees, self.fanout)

    async def stop(self) -> None:
        self.closing = True
        async with self.new_version:
            self.new_version.notify_all()  # release long polls now
        pending = [*self._tasks, *(self.judge.tasks if self.judge else ())]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._tasks.clear()
        for session in (self._session, self._checks):
            if session:
                await session.close()
        if self._runner:
            await self._runner.cleanup()

    async def publish(self, version_dir: Path | str, version: int, parent: int | None,
                      full: bool | None = None) -> Manifest:
        """Hash+sign `version_dir` (already written by the trainer) and start serving it: as a delta against
        `parent` or whole, by the config's `full_every` rule unless `full` says (see delta_publish.build_version)."""
        if self.latest is not None and version <= self.latest:
            raise ValueError(f"version {version} is not newer than the latest published ({self.latest})")
        version_dir = Path(version_dir).resolve()
        base = self.full_dirs.get(parent) if parent is not None and parent in self.versions else None
        if not want_delta(full, self._since_full, self.cfg.full_every):
            base = None
        piece = self.cfg.piece_bytes or await asyncio.to_thread(auto_piece_size, version_dir)
        m, served = await asyncio.to_thread(build_version, version_dir, version, parent, self.keypair,
                                            piece, base, self.root_dir / "deltas" / f"v{version}")
        self._since_full = 0 if m.base is None else self._since_full + 1
        self.versions[version] = VersionState(m, served, complete=True)
        self.full_dirs[version] = version_dir
        self.order[version] = InOrderRelease(m.n_pieces, 2 * self.trees)
        self.latest = version
        self._retention()
        assert self.tracker
        await asyncio.to_thread(write_atomic, self.root_dir / UPLINKS_FILE, self.tracker.uploads.dump())
        kind = f"delta against v{m.base}" if m.base is not None else "whole"
        self.tracker.event(f"publish v{version} {kind} ({m.total_size} bytes, {m.n_pieces} pieces)")
        async with self.new_version:
            self.new_version.notify_all()
        return m

    def _retention(self) -> None:
        # Stop serving all but the newest `keep`; delete only directories that live under our root_dir.
        for v in sorted(self.versions)[: -self.keep]:
            st = self.versions.pop(v)
            self.full_dirs.pop(v, None)
            self.order.pop(v, None)
            st.abandon()
            if st.dir.is_relative_to(self.root_dir) and st.dir != self.root_dir:
                shutil.rmtree(st.dir, ignore_errors=True)

    # -- what the trainer wires in -------------------------------------------------------------------
    def ban_key(self, key: str, reason: str) -> None:
        """The trainer banned this node key: it is out of the tree too (now, and when it tries to join)."""
        assert self.tracker
        self.tracker.ban_key(key, reason, "trainer")

    def set_standing(self, key: str, established: bool = True) -> None:
        """The trainer calls this key established (or no longer): its reports count, it ranks above fresh keys."""
        (self._trusted.add if established else self._trusted.discard)(key)
        if self.tracker:
            self.tracker.set_trusted(key, established)

    def _banned_here(self, key: str, reason: str) -> None:
        log.warning("banned key %s from the tree: %s", key[:16], reason)
        if self.on_ban:
            self.on_ban(key, reason)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            assert self.tracker and self.judge
            self.tracker.reap()
            for rec in self.tracker.reach_rechecks():  # a port opened later makes one a relay again
                self.judge.spawn(self.judge.recheck_reach(rec))

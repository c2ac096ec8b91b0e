"""A peer: downloads each version piece by piece from its parents, verifies, and relays to its children.

Piece i comes down tree i mod k from this peer's parent in that tree. A piece is written to disk and served
on only after its sha256 matches the signed manifest. Children may ask for a piece before we have it; the
request is held until it's verified here, which pipelines the tree piece by piece.

The peer is a few objects, each owning its state:
  tracker    TrackerClient (tracker_client.py): membership, heartbeats, reports, sources
  book       SourceBook (sourcing.py): what we know of our sources and the rules we pick them by (sans-I/O)
  fetcher    PieceFetcher (fetcher.py): each piece's race (piece_race.py) over HTTP
  downloads  Downloads (downloads.py): versions held and being fetched, with the store (store.py)
  server     RelayServer (relay_server.py): what children, the tracker and the origin ask of us
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from swarm_common.http import start_site
from swarm_common.keys import KeyPair, fingerprint

from .addresses import parse_relay_url
from .config import PeerConfig
from .downloads import Downloads
from .errors import Evicted, FetchError
from .fetcher import PieceFetcher
from .relay_server import RelayServer
from .sourcing import SourceBook
from .store import Store
from .tracker_client import Holdings, TrackerClient

__all__ = ["Evicted", "FetchError", "Peer", "PeerConfig"]
log = logging.getLogger("broadcast.peer")


class Peer:
    def __init__(self, tracker_url: str, data_dir: Path | str, trusted_public: bytes,
                 config: PeerConfig | None = None, *, keypair: KeyPair | None = None, follow: bool = True,
                 on_version: Callable[[int, Path], Awaitable[None]] | None = None):
        """`config`: the peer's knobs (broadcast/config.py). `keypair`: this peer's identity in the tree (a
        node passes its node key; None: a throwaway key). `follow`: fetch every newly published version
        automatically (relays must, to serve children). `on_version`: called with each version held."""
        if len(trusted_public) != 32:
            raise ValueError("trusted_public must be a 32-byte ed25519 public key")
        cfg = self.cfg = config or PeerConfig()
        if cfg.advertise is not None:
            parse_relay_url(cfg.advertise)  # ValueError: not a plain http://host:port
        self.trusted_public, self.follow = trusted_public, follow
        self.keypair = keypair or KeyPair.generate()
        self.store = Store(data_dir, cfg.keep)
        self.book = SourceBook(cfg)
        self.tracker = TrackerClient(tracker_url.rstrip("/"), cfg, self.keypair, trusted_public, self._holdings,
                                     self._on_latest, self._on_evicted)
        self.fetcher = PieceFetcher(self.book, self.tracker)
        self.downloads = Downloads(self.store, cfg, trusted_public, self.tracker, self.fetcher, on_version)
        self.server = RelayServer(cfg, self.keypair, self.tracker, self.downloads, lambda: self.follow)
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None

    # -- what others read -------------------------------------------------------------------------------
    tracker_url = property(lambda self: self.tracker.tracker_url)
    url = property(lambda self: self.tracker.url, doc="this relay's address as the tracker gives it to others")
    port = property(lambda self: self.tracker.port, doc="the port the relay listens on (None: not relaying)")
    reachable = property(lambda self: self.tracker.reachable)
    peer_id = property(lambda self: self.tracker.peer_id)
    evicted = property(lambda self: self.tracker.evicted)
    states = property(lambda self: self.downloads.states)
    received = property(lambda self: self.book.received, doc="verified bytes from each source since start")
    bypasses = property(lambda self: self.book.bypasses, doc="pieces for which an ancestor was asked in parallel")
    served_bytes = property(lambda self: self.server.served_bytes)

    @property
    def on_version(self):
        return self.downloads.on_version

    @on_version.setter
    def on_version(self, fn: Callable[[int, Path], Awaitable[None]] | None) -> None:
        self.downloads.on_version = fn

    def complete_versions(self) -> list[int]:
        return self.downloads.complete_versions()

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve (if a relay), then join the tracker: retried with backoff until it answers."""
        log.info("pinned trainer key fingerprint %s", fingerprint(self.trusted_public))
        self.tracker.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.cfg.stall_timeout),
            connector=aiohttp.TCPConnector(limit=0))
        self.downloads.states.update(await asyncio.to_thread(self.store.scan_complete, self.trusted_public))
        if self.cfg.relay:
            self._runner, self.tracker.port = await start_site(self.server.app(), self.tracker.host,
                                                               self.cfg.relay_port, shutdown_timeout=1.0)
        await self.tracker.connect()
        self.book.trees = self.tracker.trees
        self._tasks = [asyncio.create_task(self.tracker.heartbeat_loop()),
                       asyncio.create_task(self.tracker.watch_loop())]
        if self.tracker.peer_id:
            await self.tracker.heartbeat_once()

    async def stop(self) -> None:
        pending = [*self._tasks, *self.downloads.cancel_all(), *self.fetcher.pending()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._tasks.clear()
        await self.tracker.leave()
        for st in self.downloads.states.values():
            st.close_fds()
        if self._runner:
            await self._runner.cleanup()
        if self.tracker.session:
            await self.tracker.session.close()

    # -- versions ---------------------------------------------------------------------------------------
    async def fetch(self, version: int | None = None, timeout: float = 600.0) -> Path:
        """Return the local directory of a complete, verified version (the newest published if None)."""
        if version is None:
            version = await self.tracker.query_latest()
            if version is None:
                raise FetchError("nothing has been published yet")
        if (held := self.downloads.held(version)) is not None:
            return held
        task = self.downloads.ensure(version)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(task)
        except TimeoutError:
            st = self.downloads.states.get(version)
            got = f"{st.n_have}/{len(st.pieces)} pieces" if st else "no manifest"
            raise FetchError(f"timed out after {timeout:.0f}s fetching v{version} ({got})") from None
        return self.downloads.states[version].dir

    async def wait_version(self, min_version: int, timeout: float | None = None) -> Path:
        """Wait until a complete version >= min_version is held; return the newest such directory."""

        def ready() -> bool:
            held = self.complete_versions()
            return bool(held) and held[-1] >= min_version or self.evicted is not None

        async with asyncio.timeout(timeout):
            await self.downloads.until(ready)
        if self.evicted:
            raise Evicted(self.evicted)
        return self.downloads.states[self.complete_versions()[-1]].dir

    # -- what the tracker client asks and tells ------------------------------------------------------------
    def _holdings(self) -> Holdings:
        return Holdings(self.complete_versions(), self.downloads.progress(), self.server.served_bytes,
                        self.book.received, self.book.meter.take())

    def _on_latest(self, latest: int) -> None:
        self.book.trees = self.tracker.trees
        self.downloads.changed()
        if self.follow and latest not in self.complete_versions():
            self.downloads.ensure(latest)

    def _on_evicted(self, why: str) -> None:
        self.downloads.cancel_all()
        self.downloads.changed()

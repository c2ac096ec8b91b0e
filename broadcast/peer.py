"""A peer: downloads each version piece by piece from its parents, verifies, and relays to its children.

Piece i comes down tree i mod k from this peer's parent in that tree. A piece is written to disk and served
on only after its sha256 matches the signed manifest. Children may ask for a piece before we have it; the
request is held until it's verified here, which pipelines the tree piece by piece.

A parent that does not answer is bypassed within about a piece time (sourcing.py); the tracker side of
membership (signed join, heartbeats, reports, the connect-back answer) is membership.py's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

from swarm_common.http import read_capped, start_site
from swarm_common.keys import KeyPair, fingerprint

from .addresses import is_loopback, parse_relay_url
from .config import PeerConfig
from .delta_fetch import materialize
from .manifest import MAX_MANIFEST_BYTES, ManifestError, decode_manifest, encode_manifest
from .membership import Evicted, FetchError, Membership
from .messages import Leave
from .ratelimit import RateLimiter
from .receive_meter import ReceiveMeter
from .serving import MAX_VERSION, Turns, parse_int, serve_piece
from .sourcing import Sourcing
from .store import Store, VersionState
from .uplink_probe import PROBE_PATH, ProbeServer

__all__ = ["Evicted", "FetchError", "Peer", "PeerConfig"]
log = logging.getLogger("broadcast.peer")


class Peer(Membership, Sourcing):
    def __init__(
        self,
        tracker_url: str,
        data_dir: Path | str,
        trusted_public: bytes,
        config: PeerConfig | None = None,
        *,
        keypair: KeyPair | None = None,
        follow: bool = True,
        on_version: Callable[[int, Path], Awaitable[None]] | None = None,
    ):
        """`config`: the peer's knobs (broadcast/config.py). `keypair`: this peer's identity in the tree (a
        node passes its node key; None: a throwaway key). `follow`: fetch every newly published version
        automatically (relays must, to serve children). `on_version`: called with each version held."""
        if len(trusted_public) != 32:
            raise ValueError("trusted_public must be a 32-byte ed25519 public key")
        cfg = self.cfg = config or PeerConfig()
        if cfg.advertise is not None:
            parse_relay_url(cfg.advertise)  # ValueError: not a plain http://host:port
        self.tracker_url = tracker_url.rstrip("/")
        self.store = Store(data_dir, cfg.keep)
        self.trusted_public = trusted_public
        host = cfg.relay_host
        if host is None:
            host = "127.0.0.1" if is_loopback(URL(self.tracker_url).host or "") else "0.0.0.0"
        self.host, self.port = host, cfg.relay_port  # where the relay listens (the port once bound)
        self.relay = cfg.relay
        self.limiter = RateLimiter(cfg.upload_rate)
        self.name = cfg.name
        self.follow = follow
        self.on_version = on_version
        self.window = cfg.window
        self.stall_timeout = cfg.stall_timeout
        self.progress = cfg.progress
        self.keypair = keypair or KeyPair.generate()
        self.advertise = cfg.advertise
        self.first_byte_timeout = cfg.first_byte_timeout
        self.url: str | None = None  # as the tracker gives it to others
        self.observed_host = ""
        self.reachable: bool | None = None
        self._leaf_only = False
        self.peer_id: str | None = None
        self._token = ""
        self.trees = 1
        self._turns = Turns()  # serving.py: a child's requests take turns
        self.heartbeat_interval = 2.0
        self.sources: list[list[str]] = [[self.tracker_url]]
        self._sources_tag = ""  # the tracker's name for them: it sends them again only when they change
        self.known_latest: int | None = None
        self.states: dict[int, VersionState] = {}
        self.evicted: str | None = None
        self.served_bytes = 0
        self.received: dict[str, int] = {}
        self.bypasses = 0  # pieces for which an alternate source was asked in parallel
        self._answer_s: float | None = None  # smoothed time to a source's answer
        self._answer_var = 0.0  # and its smoothed deviation
        self._latency_s: float | None = None  # smoothed time from asking for a piece to holding it
        self._pieces_in = 0  # verified pieces received, from anyone
        self._last_heard: dict[str, float] = {}  # per source: when it last answered or sent us bytes
        # per source: when it last sent us piece bytes, and _pieces_in then
        self._last_bytes: dict[str, tuple[float, int]] = {}
        self._downloads: dict[int, asyncio.Task] = {}
        self._blacklist: dict[str, float] = {}
        self._received = ReceiveMeter()  # per source: what came and how long it took (placement evidence)
        self._changed = asyncio.Condition()  # states/latest changed
        self._hb_now = asyncio.Event()
        self._hb_started = self._hb_finished = 0  # heartbeats of the loop begun and done (membership.py)
        self._hb_done = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self._bg: set[asyncio.Task] = set()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve (if a relay), then join the tracker: retried with backoff until it answers."""
        log.info("pinned trainer key fingerprint %s", fingerprint(self.trusted_public))
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.stall_timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.states.update(await asyncio.to_thread(self.store.scan_complete, self.trusted_public))
        app = web.Application(client_max_size=4096)
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/reach", self._reach),
                web.get(PROBE_PATH, ProbeServer(self.limiter, lambda: self._token).handle),  # the tracker's
                web.get("/v/{version}/manifest", self._manifest),
                web.get("/v/{version}/piece/{index}", self._piece),
            ]
        )
        if self.relay:
            self._runner, self.port = await start_site(app, self.host, self.port, shutdown_timeout=1.0)
        else:
            self.port = None  # type: ignore[assignment]
        await self._connect()
        self._tasks = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._watch_loop())]
        if self.peer_id:
            await self._heartbeat_once()

    async def stop(self) -> None:
        for t in [*self._tasks, *self._downloads.values(), *self._bg]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._downloads.values(), *self._bg, return_exceptions=True)
        self._tasks.clear()
        if self._session and self.peer_id and not self.evicted:
            try:
                await self._post("/leave", Leave(self.peer_id, self._token), timeout=2)
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
        for st in self.states.values():
            st.close_fds()
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    # -- public API -------------------------------------------------------------------------------------
    def complete_versions(self) -> list[int]:
        return sorted(v for v, st in self.states.items() if st.complete)

    async def fetch(self, version: int | None = None, timeout: float = 600.0) -> Path:
        """Return the local directory of a complete, verified version (the newest published if None)."""
        if version is None:
            latest = await self._query_latest()
            if latest is None:
                raise FetchError("nothing has been published yet")
            version = latest
        st = self.states.get(version)
        if st is not None and st.complete:
            return st.dir
        task = self._ensure_download(version)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(task)
        except TimeoutError:
            st = self.states.get(version)
            got = f"{st.n_have}/{len(st.pieces)} pieces" if st else "no manifest"
            raise FetchError(f"timed out after {timeout:.0f}s fetching v{version} ({got})") from None
        return self.states[version].dir

    async def wait_version(self, min_version: int, timeout: float | None = None) -> Path:
        """Wait until a complete version >= min_version is held; return the newest such directory."""

        def ready() -> bool:
            return bool(self.complete_versions()) and self.complete_versions()[-1] >= min_version

        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: ready() or self.evicted is not None)
        if self.evicted:
            raise Evicted(self.evicted)
        return self.states[self.complete_versions()[-1]].dir

    # -- downloading ------------------------------------------------------------------------------------
    def _ensure_download(self, version: int) -> asyncio.Task:
        task = self._downloads.get(version)
        if task is None:
            task = asyncio.create_task(self._download(version))
            self._downloads[version] = task
            task.add_done_callback(lambda t, v=version: self._download_done(v, t))
        return task

    def _download_done(self, version: int, task: asyncio.Task) -> None:
        self._downloads.pop(version, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("v%d: %s", version, task.exception())
            st = self.states.get(version)
            if st is not None and not st.complete:
                self.states.pop(version).abandon()  # stays on disk in partial/ to resume later

    async def _get_manifest(self, version: int):
        """From the nearest ancestor that holds it, else the origin: it is signed, so any peer may serve it,
        and N peers all asking the origin would spend N manifests of the origin's uplink."""
        for src in self._chain(version % self.trees)[:-1]:
            try:
                return await self._manifest_from(src, version)
            except FetchError as e:
                log.info("v%d manifest not from %s (%s): asking the next one up", version, src, e)
        return await self._manifest_from(self.tracker_url, version)

    async def _manifest_from(self, src: str, version: int):
        assert self._session
        who = "the origin" if src == self.tracker_url else src
        try:
            # An ancestor gets as long as a piece's first byte (a frozen relay must not hold up the version);
            # the origin, the whole stall timeout.
            quick = src != self.tracker_url
            timeout = aiohttp.ClientTimeout(total=self.stall_timeout, sock_connect=2 * self.first_byte_timeout
                                            if quick else None, sock_read=2 * self.first_byte_timeout if quick else None)
            async with self._session.get(f"{src}/v/{version}/manifest", timeout=timeout) as r:
                if r.status == 404:
                    raise FetchError(f"v{version} is not available from {who} (retired or never published)")
                if r.status != 200:
                    raise FetchError(f"{who} answered {r.status} for the v{version} manifest")
                data = await read_capped(r.content, MAX_MANIFEST_BYTES)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise FetchError(f"could not get the v{version} manifest from {who}: {e}") from e
        try:
            m = decode_manifest(data, self.trusted_public)
        except ManifestError as e:
            log.error("REFUSED manifest for v%d from %s: %s", version, who, e)
            raise FetchError(f"refused the v{version} manifest: {e}") from e
        if m.version != version:
            raise FetchError(f"asked for the v{version} manifest, got one for v{m.version}")
        return m

    async def _download(self, version: int) -> Path:
        if self.evicted:
            raise Evicted(self.evicted)
        await self._heartbeat_once()  # parents may have changed since the last beat: start from fresh ones
        m = await self._get_manifest(version)
        st = await asyncio.to_thread(self.store.open_partial, m)
        async with self._changed:
            self.states[version] = st
            self._changed.notify_all()
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=m.total_size, unit="B", unit_scale=True, desc=f"v{version}", leave=False)
            bar.update(sum(st.pieces[i].size for i in range(len(st.pieces)) if st.have[i]))
        t0 = time.monotonic()
        queues = [collections.deque(i for i in range(t, len(st.pieces), self.trees) if not st.have[i])
                  for t in range(self.trees)]
        workers = [asyncio.create_task(self._worker(st, t, queues[t], bar))
                   for t in range(self.trees) for _ in range(self.window)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            if bar:
                bar.close()
        if m.base is not None:  # a delta: its pieces become the version's files first (delta_fetch.py)
            await materialize(self, st)
        path = await asyncio.to_thread(self.store.finalize, st)
        dt = time.monotonic() - t0
        log.info("v%d complete: %d bytes in %.2fs (%.1f MB/s)", version, m.total_size, dt, m.total_size / dt / 1e6)
        protect = set(self._downloads) | {version}
        for v in self.store.retention(protect):
            gone = self.states.pop(v, None)
            if gone:
                gone.abandon()
            log.info("retention: deleted v%d", v)
        async with self._changed:
            self._changed.notify_all()
        self._hb_now.set()
        if self.on_version:
            await self.on_version(version, path)
        return path

    async def _worker(self, st: VersionState, tree: int, queue: collections.deque, bar) -> None:
        while queue:
            i = queue.popleft()
            if not st.have[i]:
                await self._fetch_piece(st, i, tree)
                if bar:
                    bar.update(st.pieces[i].size)

    # -- serving ----------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "versions": self.complete_versions()})

    async def _manifest(self, request: web.Request) -> web.Response:
        """The signed manifest of a version held here: children need not all ask the origin for it."""
        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        st = None if self.evicted else await self._lookup(version)
        if st is None:
            raise web.HTTPNotFound(text=f"version {version} not held here")
        return web.Response(body=encode_manifest(st.manifest), content_type="application/json")

    async def _lookup(self, version: int) -> VersionState | None:
        st = self.states.get(version)
        if st is None and self.follow and (version in self._downloads or self.known_latest is None
                                           or version > self.known_latest):
            # A child heard of the version before we did, or asks while we still fetch its manifest: we're
            # about to hold it. (A 404 here would send the child, and its children, to the origin.)
            try:
                async with asyncio.timeout(self.stall_timeout / 2), self._changed:
                    await self._changed.wait_for(lambda: version in self.states)
            except TimeoutError:
                return None
            st = self.states.get(version)
        return st

    def _sent(self, n: int) -> None:
        self.served_bytes += n

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        if self.evicted:
            raise web.HTTPNotFound(text="evicted")
        return await serve_piece(request, self._lookup, self.limiter, self.cfg.hold_s, self._turns,
                                 self.trees, self._sent)

"""A peer's versions: the ones it holds (on disk, in the store) and the ones it is fetching, one task each.

A version's manifest comes from the nearest ancestor that holds it (it is signed, so any peer may serve it,
and N peers all asking the origin would spend N manifests of the origin's uplink), its pieces from the
fetcher (fetcher.py: `window` requests in flight per tree), then a delta becomes its files
(delta_fetch.py), the store publishes the directory, and retention drops the oldest. delta_fetch.py sees
this object only through its `Versions` interface: held, pending, ensure, manifest, session, origin_url,
pass_headers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from swarm_common.http import read_capped

from .config import PeerConfig
from .delta_fetch import materialize
from .errors import Evicted, FetchError
from .fetcher import PieceFetcher
from .manifest import MAX_MANIFEST_BYTES, Manifest, ManifestError, decode_manifest
from .messages import ORIGIN
from .piece_pass import headers
from .store import Store, VersionState
from .tracker_client import TrackerClient

log = logging.getLogger("broadcast.peer")


class Downloads:
    def __init__(self, store: Store, cfg: PeerConfig, trusted_public: bytes, tracker: TrackerClient,
                 fetcher: PieceFetcher, on_version: Callable[[int, Path], Awaitable[None]] | None):
        self.store, self.cfg, self.trusted_public = store, cfg, trusted_public
        self.tracker, self.fetcher, self.on_version = tracker, fetcher, on_version
        self.origin_url = tracker.tracker_url
        self.states: dict[int, VersionState] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self._changed = asyncio.Event()  # set and replaced whenever states or the newest version change

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self.tracker.session
        return self.tracker.session

    def pass_headers(self, name: str) -> dict[str, str]:
        """This member's id and pass for `name` (piece_pass.py: the origin serves members only)."""
        return headers(self.tracker.peer_id, self.tracker.token, name)

    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def until(self, ready: Callable[[], bool]) -> None:
        while not ready():
            await self._changed.wait()

    # -- what is held ------------------------------------------------------------------------------------
    def complete_versions(self) -> list[int]:
        return sorted(v for v, st in self.states.items() if st.complete)

    def progress(self) -> dict[int, int]:
        return {v: st.n_have for v, st in self.states.items() if not st.complete}

    def held(self, version: int) -> Path | None:
        st = self.states.get(version)
        return st.dir if st is not None and st.complete else None

    def pending(self, version: int) -> asyncio.Task | None:
        return self.tasks.get(version)

    async def lookup(self, version: int, follow: bool) -> VersionState | None:
        """The version as a child asks for it. One a child heard of before we did, or asks for while we
        still fetch its manifest, is about to be held: wait for it (a 404 here would send the child, and its
        children, to the origin)."""
        st = self.states.get(version)
        known = self.tracker.known_latest
        if st is None and follow and (version in self.tasks or known is None or version > known):
            try:
                async with asyncio.timeout(self.cfg.stall_timeout / 2):
                    await self.until(lambda: version in self.states)
            except TimeoutError:
                return None
            st = self.states.get(version)
        return st

    # -- fetching ------------------------------------------------------------------------------------
    def ensure(self, version: int) -> asyncio.Task:
        task = self.tasks.get(version)
        if task is None:
            task = self.tasks[version] = asyncio.create_task(self._download(version))
            task.add_done_callback(lambda t, v=version: self._done(v, t))
        return task

    def _done(self, version: int, task: asyncio.Task) -> None:
        self.tasks.pop(version, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("v%d: %s", version, task.exception())
            st = self.states.get(version)
            if st is not None and not st.complete:
                self.states.pop(version).abandon()  # stays on disk in partial/ to resume later

    def cancel_all(self) -> list[asyncio.Task]:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        return tasks

    async def manifest(self, version: int) -> Manifest:
        """From the nearest ancestor that holds it, else the origin."""
        for src in self.fetcher.book.chain(self.tracker.relays(version % self.tracker.trees), time.monotonic())[:-1]:
            try:
                return await self._manifest_from(src, version)
            except FetchError as e:
                log.info("v%d manifest not from %s (%s): asking the next one up", version, src, e)
        return await self._manifest_from(ORIGIN, version)

    async def _manifest_from(self, src: str, version: int) -> Manifest:
        origin = src == ORIGIN
        who, url = ("the origin", self.origin_url) if origin else (src, src)
        # An ancestor gets as long as a piece's first byte (a frozen relay must not hold up the version);
        # the origin, the whole stall timeout.
        quick = None if origin else 2 * self.cfg.first_byte_timeout
        timeout = aiohttp.ClientTimeout(total=self.cfg.stall_timeout, sock_connect=quick, sock_read=quick)
        try:
            async with self.session.get(f"{url}/v/{version}/manifest", timeout=timeout) as r:
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
        if self.tracker.evicted:
            raise Evicted(self.tracker.evicted)
        await self.tracker.heartbeat_once()  # parents may have changed since the last beat: start from fresh ones
        m = await self.manifest(version)
        st = await asyncio.to_thread(self.store.open_partial, m)
        self.states[version] = st
        self.changed()
        bar = None
        if self.cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=m.total_size, unit="B", unit_scale=True, desc=f"v{version}", leave=False)
            bar.update(sum(st.pieces[i].size for i in range(len(st.pieces)) if st.have[i]))
        t0, trees = time.monotonic(), self.tracker.trees
        queues = [collections.deque(i for i in range(t, len(st.pieces), trees) if not st.have[i])
                  for t in range(trees)]
        workers = [asyncio.create_task(self._worker(st, t, queues[t], bar))
                   for t in range(trees) for _ in range(self.cfg.window)]
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
        for v in self.store.retention(set(self.tasks) | {version}):
            gone = self.states.pop(v, None)
            if gone:
                gone.abandon()
            log.info("retention: deleted v%d", v)
        self.changed()
        self.tracker.hb_now.set()
        if self.on_version:
            await self.on_version(version, path)
        return path

    async def _worker(self, st: VersionState, tree: int, queue: collections.deque, bar) -> None:
        while queue:
            i = queue.popleft()
            if not st.have[i]:
                await self.fetcher.fetch_piece(st, i, tree)
                if bar:
                    bar.update(st.pieces[i].size)

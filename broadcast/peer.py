"""A peer: downloads each version piece by piece from its parents, verifies, and relays to its children.

Piece i comes down tree i mod k from this peer's parent in that tree. A piece is written to disk and served
on only after its sha256 matches the signed manifest. Children may ask for a piece before we have it; the
request is held until it's verified here, which pipelines the tree piece by piece.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from swarm_common.http import read_capped, start_site
from swarm_common.keys import fingerprint

from .manifest import MAX_MANIFEST_BYTES, ManifestError, decode_manifest, encode_manifest
from .messages import Join, Joined, Latest, Leave, PeerHeartbeat, Report, TreeSources, decode
from .ratelimit import RateLimiter
from .serving import MAX_VERSION, parse_int, serve_piece
from .store import Store, VersionState

log = logging.getLogger("broadcast.peer")
MAX_FAILURES_PER_PIECE = 20
TEMP_BLACKLIST_S = 30.0
RECV_CHUNK = 1 << 20  # a piece arrives in a few reads, not one per 64 KiB


class FetchError(RuntimeError):
    """A version could not be fetched and verified; nothing partial is ever returned."""


class Evicted(FetchError):
    """The tracker removed this peer (e.g. it was caught serving corrupt data)."""


class Peer:
    def __init__(
        self,
        tracker_url: str,
        data_dir: Path | str,
        trusted_public: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        relay: bool = True,
        keep: int = 3,
        upload_rate: float | None = None,
        *,
        name: str = "",
        follow: bool = True,
        on_version: Callable[[int, Path], Awaitable[None]] | None = None,
        window: int = 2,
        stall_timeout: float = 30.0,
        progress: bool = False,
    ):
        """`follow`: fetch every newly published version automatically (relays must, to serve children).
        `window`: requests in flight per tree, keeps each parent's pipe full across piece boundaries."""
        if len(trusted_public) != 32:
            raise ValueError("trusted_public must be a 32-byte ed25519 public key")
        self.tracker_url = tracker_url.rstrip("/")
        self.store = Store(data_dir, keep)
        self.trusted_public = trusted_public
        self.host, self.port = host, port
        self.relay = relay
        self.limiter = RateLimiter(upload_rate)
        self.name = name
        self.follow = follow
        self.on_version = on_version
        self.window = max(1, window)
        self.stall_timeout = stall_timeout
        self.progress = progress
        self.url: str | None = None
        self.peer_id: str | None = None
        self._token = ""
        self.trees = 1
        self.heartbeat_interval = 2.0
        self.sources: list[list[str]] = [[self.tracker_url]]
        self.known_latest: int | None = None
        self.states: dict[int, VersionState] = {}
        self.evicted: str | None = None
        self._downloads: dict[int, asyncio.Task] = {}
        self._blacklist: dict[str, float] = {}
        self._changed = asyncio.Condition()  # states/latest changed
        self._hb_now = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> None:
        log.info("pinned trainer key fingerprint %s", fingerprint(self.trusted_public))
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.stall_timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.states.update(await asyncio.to_thread(self.store.scan_complete, self.trusted_public))
        if self.relay:
            app = web.Application(client_max_size=4096)
            app.add_routes(
                [
                    web.get("/health", self._health),
                    web.get("/v/{version}/piece/{index}", self._piece),
                    web.get("/v/{version}/manifest", self._manifest),
                ]
            )
            self._runner, self.port = await start_site(app, self.host, self.port, shutdown_timeout=1.0)
            self.url = f"http://{self.host}:{self.port}"
        await self._check_tracker_key()
        await self._join()
        self._tasks = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._watch_loop())]

    async def stop(self) -> None:
        for t in [*self._tasks, *self._downloads.values()]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._downloads.values(), return_exceptions=True)
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

    # -- tracker ----------------------------------------------------------------------------------------
    async def _post(self, path: str, msg: msgspec.Struct, timeout: float = 10) -> tuple[int, bytes]:
        assert self._session
        async with self._session.post(
            self.tracker_url + path,
            data=msgspec.json.encode(msg),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            return r.status, await read_capped(r.content, 1 << 20)

    async def _check_tracker_key(self) -> None:
        assert self._session
        for attempt in range(20):
            try:
                async with self._session.get(self.tracker_url + "/info", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    info = msgspec.json.decode(await read_capped(r.content, 4096))
                break
            except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError) as e:
                if attempt == 19:
                    raise FetchError(f"tracker {self.tracker_url} unreachable: {e}") from e
                await asyncio.sleep(0.5)
        theirs = info.get("public_key") if isinstance(info, dict) else None
        if theirs != self.trusted_public.hex():
            # Not fatal on its own (manifests are what we check), but almost surely a misconfiguration.
            log.error("tracker signs with key %s, but we pin %s: its manifests will be refused",
                      fingerprint(theirs) if isinstance(theirs, str) and len(theirs) == 64 else "?",
                      fingerprint(self.trusted_public))

    async def _join(self) -> None:
        status, body = await self._post("/join", Join(self.url, self.relay and self.url is not None, self.name))
        if status != 200:
            raise FetchError(f"tracker refused join: {status} {body[:200].decode(errors='replace')}")
        j = decode(body, Joined)
        if not 1 <= j.trees <= 64 or not 0.05 <= j.heartbeat_interval <= 600:
            raise FetchError(f"tracker sent an implausible config: {j}")
        self.peer_id, self._token, self.trees, self.heartbeat_interval = (
            j.peer_id, j.token, j.trees, j.heartbeat_interval)
        self.sources = [[self.tracker_url] for _ in range(self.trees)]
        log.info("joined %s as %s (%s), %d trees", self.tracker_url, self.peer_id, self.url or "no relay", self.trees)
        await self._heartbeat_once()

    async def _heartbeat_once(self) -> None:
        assert self.peer_id
        progress = {v: st.n_have for v, st in self.states.items() if not st.complete}
        msg = PeerHeartbeat(self.peer_id, self._token, self.complete_versions(), progress)
        try:
            status, body = await self._post("/heartbeat", msg)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("heartbeat failed (%s); keeping current parents", e)
            return
        if status == 404:
            log.warning("tracker forgot us; joining again")
            await self._join()
            return
        if status == 410:
            await self._set_evicted(body[:300].decode(errors="replace"))
            return
        if status != 200:
            log.warning("heartbeat refused: %s %s", status, body[:200])
            return
        try:
            a = decode(body, TreeSources)
            if len(a.sources) != self.trees or not all(
                0 < len(c) <= 64 and all(u.startswith("http://") and len(u) < 256 for u in c) for c in a.sources
            ):
                raise ValueError("malformed sources")
        except (msgspec.DecodeError, ValueError) as e:
            log.warning("bad assignment from tracker: %s", e)
            return
        self.sources = a.sources
        if a.latest is not None:
            await self._note_latest(a.latest)

    async def _set_evicted(self, why: str) -> None:
        log.error("evicted by the tracker: %s", why)
        self.evicted = why
        for t in self._downloads.values():
            t.cancel()
        async with self._changed:
            self._changed.notify_all()

    async def _heartbeat_loop(self) -> None:
        while not self.evicted:
            try:
                async with asyncio.timeout(self.heartbeat_interval):
                    await self._hb_now.wait()
            except TimeoutError:
                pass
            self._hb_now.clear()
            try:
                await self._heartbeat_once()
            except FetchError as e:
                log.warning("%s", e)

    async def _query_latest(self, after: int | None = None, wait: float = 0) -> int | None:
        assert self._session
        q = f"?after={after}&wait={wait}" if after is not None else ""
        async with self._session.get(
            f"{self.tracker_url}/latest{q}", timeout=aiohttp.ClientTimeout(total=wait + 10)
        ) as r:
            if r.status != 200:
                raise FetchError(f"tracker /latest answered {r.status}")
            lat = decode(await read_capped(r.content, 1 << 16), Latest)
        return lat.latest

    async def _watch_loop(self) -> None:
        """Long-poll the tracker so a new version starts flowing at once, not at the next heartbeat."""
        while not self.evicted:
            try:
                latest = await self._query_latest(self.known_latest if self.known_latest is not None else -1, 20)
                if latest is not None:
                    await self._note_latest(latest)
            except (TimeoutError, aiohttp.ClientError, OSError, FetchError, msgspec.DecodeError) as e:
                log.warning("watching the tracker failed (%s)", e)
                await asyncio.sleep(1)

    async def _note_latest(self, latest: int) -> None:
        if latest < 0 or (self.known_latest is not None and latest <= self.known_latest):
            return
        self.known_latest = latest
        async with self._changed:
            self._changed.notify_all()
        if self.follow:
            self._ensure_download(latest)

    async def _report(self, url: str, reason: str, version: int, piece: int, detail: str) -> None:
        log.warning("reporting %s as %s (v%d piece %d): %s", url, reason, version, piece, detail)
        if not self.peer_id:
            return
        try:
            status, body = await self._post(
                "/report", Report(self.peer_id, self._token, url, reason, version, piece, detail[:200]))  # type: ignore[arg-type]
            log.info("tracker on %s: %s %s", url, status, body[:100].decode(errors="replace"))
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("could not report %s: %s", url, e)
        self._hb_now.set()  # fetch the new assignment now

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
            async with self._session.get(f"{src}/v/{version}/manifest",
                                         timeout=aiohttp.ClientTimeout(total=self.stall_timeout)) as r:
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

    def _chain(self, tree: int) -> list[str]:
        now = time.monotonic()
        chain = [u for u in self.sources[tree % len(self.sources)] if self._blacklist.get(u, 0) < now]
        if not chain or chain[-1] != self.tracker_url:
            chain.append(self.tracker_url)  # the origin is the root of every tree
        return chain

    async def _fetch_piece(self, st: VersionState, index: int, tree: int) -> None:
        failures = 0
        while True:
            if self.evicted:
                raise Evicted(self.evicted)
            for src in self._chain(tree):
                outcome = await self._try_source(src, st, index)
                if outcome == "ok":
                    return
                if outcome == "absent":
                    if src == self.tracker_url:
                        raise FetchError(f"v{st.version} is no longer served by the origin")
                    continue  # not held there (e.g. retired): try the next ancestor for this piece
                failures += 1
                break
            if failures >= MAX_FAILURES_PER_PIECE:
                raise FetchError(f"v{st.version} piece {index}: {failures} failed attempts, giving up")
            await asyncio.sleep(min(0.1 * failures, 2.0))

    async def _try_source(self, src: str, st: VersionState, index: int) -> str:
        """Fetch one piece from one source; 'ok', 'absent' (404), or 'failed' (reported + avoided)."""
        assert self._session
        ref = st.pieces[index]
        reason, detail = "dead", ""
        try:
            async with self._session.get(f"{src}/v/{st.version}/piece/{index}",
                                         headers={"X-Peer": self.peer_id or ""}) as r:
                if r.status == 404:
                    return "absent"
                if r.status != 200:
                    reason, detail = ("stall" if r.status == 503 else "dead"), f"HTTP {r.status}"
                elif r.content_length is not None and r.content_length != ref.size:
                    reason, detail = "corrupt", f"length {r.content_length} != {ref.size}"
                else:
                    chunks, got = [], 0
                    async for chunk in r.content.iter_chunked(RECV_CHUNK):
                        chunks.append(chunk)
                        got += len(chunk)
                        if got > ref.size:
                            break
                    buf = b"".join(chunks)
                    if len(buf) != ref.size:
                        reason, detail = "corrupt", f"{len(buf)} bytes, expected {ref.size}"
                    # Hashing in a thread (hashlib lets go of the GIL): the loop goes on receiving meanwhile.
                    elif not await asyncio.to_thread(ref.matches, buf):
                        reason, detail = "corrupt", "sha256 mismatch"
                    elif st.abandoned:
                        return "ok"  # the download was dropped meanwhile; nothing to write
                    else:
                        if not st.have[index]:
                            st.write_piece(index, buf)  # on the loop: abandon() closes these files there
                            st.mark(index)
                        return "ok"
        except TimeoutError:
            reason, detail = "stall", f"no data for {self.stall_timeout}s"
        except (aiohttp.ClientError, OSError) as e:
            reason, detail = "dead", f"{type(e).__name__}: {e}"
        if src == self.tracker_url:
            log.warning("origin failed for v%d piece %d (%s): retrying", st.version, index, detail)
            return "failed"
        self._blacklist[src] = float("inf") if reason == "corrupt" else time.monotonic() + TEMP_BLACKLIST_S
        await self._report(src, reason, st.version, index, detail)
        return "failed"

    # -- serving ----------------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "versions": self.complete_versions()})

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

    async def _manifest(self, request: web.Request) -> web.Response:
        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        st = None if self.evicted else await self._lookup(version)
        if st is None:
            raise web.HTTPNotFound(text=f"version {version} not held here")
        return web.Response(body=encode_manifest(st.manifest), content_type="application/json")

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        if self.evicted:
            raise web.HTTPNotFound(text="evicted")
        return await serve_piece(request, self._lookup, self.limiter, self.stall_timeout * 0.6)

"""The origin: tracker + root seed in one aiohttp app, embeddable in the trainer's own event loop."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from swarm_common.http import read_capped, start_site
from swarm_common.keys import KeyPair

from .manifest import Manifest, auto_piece_size, build_manifest, encode_manifest
from .messages import MAX_TRACKER_MESSAGE_BYTES, Join, Latest, Leave, PeerHeartbeat, Report, decode
from .ratelimit import RateLimiter
from .release import InOrderRelease
from .serving import MAX_VERSION, parse_int, serve_piece
from .store import VersionState
from .tracker import Tracker, TrackerError

log = logging.getLogger("broadcast.origin")


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


class Origin:
    def __init__(
        self,
        root_dir: Path | str,
        keypair: KeyPair,
        host: str = "127.0.0.1",
        port: int = 0,
        fanout: int = 4,
        keep: int = 3,
        *,
        trees: int | None = None,
        upload_rate: float | None = None,
        piece_size: int = 4 << 20,
        heartbeat_interval: float = 2.0,
        piece_wait: float = 20.0,
    ):
        """`trees` defaults to `fanout`: that is what lets every relay upload exactly what it downloads.
        `piece_size` 0: chosen per version from its size (manifest.auto_piece_size)."""
        self.root_dir = Path(root_dir).resolve()
        self.keypair = keypair
        self.host, self.port = host, port
        self.fanout, self.keep = fanout, keep
        self.trees = trees or fanout
        self.piece_size = piece_size
        self.piece_wait = piece_wait
        self.limiter = RateLimiter(upload_rate)
        self.heartbeat_interval = heartbeat_interval
        self.versions: dict[int, VersionState] = {}
        self.latest: int | None = None
        self.tracker: Tracker | None = None
        self._new_version = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._url: str | None = None
        self._closing = False
        self._order: dict[int, InOrderRelease] = {}  # per version: its pieces leave about in order

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("Origin not started")
        return self._url

    async def start(self) -> None:
        self.root_dir.mkdir(parents=True, exist_ok=True)
        app = web.Application(client_max_size=MAX_TRACKER_MESSAGE_BYTES)
        app.add_routes(
            [
                web.post("/join", self._join),
                web.post("/heartbeat", self._heartbeat),
                web.post("/report", self._report),
                web.post("/leave", self._leave),
                web.get("/latest", self._latest),
                web.get("/tree", self._tree),
                web.get("/health", self._health),
                web.get("/info", self._info),
                web.get("/v/{version}/manifest", self._manifest),
                web.get("/v/{version}/piece/{index}", self._piece),
            ]
        )
        # Short shutdown: long polls and held piece requests must not keep stop() waiting.
        self._runner, self.port = await start_site(app, self.host, self.port, shutdown_timeout=1.0)
        self._url = f"http://{self.host}:{self.port}"
        self.tracker = Tracker(self._url, self.trees, self.fanout, self.heartbeat_interval)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._tasks.append(asyncio.create_task(self._reaper()))
        log.info("origin at %s, trainer key %s, %d trees, fanout %d", self._url, self.keypair.fingerprint,
                 self.trees, self.fanout)

    async def stop(self) -> None:
        self._closing = True
        async with self._new_version:
            self._new_version.notify_all()  # release long polls now
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._session:
            await self._session.close()
        if self._runner:
            await self._runner.cleanup()

    async def publish(self, version_dir: Path | str, version: int, parent: int | None) -> Manifest:
        """Hash+sign `version_dir` (already written by the trainer) and start serving it."""
        if self.latest is not None and version <= self.latest:
            raise ValueError(f"version {version} is not newer than the latest published ({self.latest})")
        version_dir = Path(version_dir).resolve()
        piece = self.piece_size or await asyncio.to_thread(auto_piece_size, version_dir)
        m = await asyncio.to_thread(build_manifest, version_dir, version, parent, self.keypair, piece)
        self.versions[version] = VersionState(m, version_dir, complete=True)
        self._order[version] = InOrderRelease(m.n_pieces, 2 * self.trees)
        self.latest = version
        self._retention()
        assert self.tracker
        self.tracker.event(f"publish v{version} ({m.total_size} bytes, {m.n_pieces} pieces)")
        async with self._new_version:
            self._new_version.notify_all()
        return m

    def _retention(self) -> None:
        # Stop serving all but the newest `keep`; delete only directories that live under our root_dir.
        for v in sorted(self.versions)[: -self.keep]:
            st = self.versions.pop(v)
            self._order.pop(v, None)
            st.abandon()
            if st.dir.is_relative_to(self.root_dir) and st.dir != self.root_dir:
                shutil.rmtree(st.dir, ignore_errors=True)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            assert self.tracker
            self.tracker.reap()

    # -- handlers ---------------------------------------------------------------------------------------
    async def _body(self, request: web.Request, typ: type):
        try:
            return decode(await request.read(), typ)
        except (msgspec.DecodeError, ValueError) as e:
            raise web.HTTPBadRequest(text=f"bad {typ.__name__}: {e}") from e

    def _tracker_call(self, fn, *args):
        try:
            return fn(*args)
        except TrackerError as e:
            raise _status(e.status, str(e)) from e

    async def _join(self, request: web.Request) -> web.Response:
        msg: Join = await self._body(request, Join)
        if msg.url is not None and not _valid_url(msg.url):
            raise web.HTTPBadRequest(text="url must be http://host:port")
        assert self.tracker
        return _json(self._tracker_call(self.tracker.join, msg))

    async def _heartbeat(self, request: web.Request) -> web.Response:
        msg: PeerHeartbeat = await self._body(request, PeerHeartbeat)
        assert self.tracker
        return _json(self._tracker_call(self.tracker.heartbeat, msg, self.latest))

    async def _leave(self, request: web.Request) -> web.Response:
        msg: Leave = await self._body(request, Leave)
        assert self.tracker
        self._tracker_call(self.tracker.auth, msg.peer_id, msg.token)
        self.tracker.remove(msg.peer_id, "left")
        return _json({"ok": True})

    async def _report(self, request: web.Request) -> web.Response:
        msg: Report = await self._body(request, Report)
        assert self.tracker
        reporter = self._tracker_call(self.tracker.auth, msg.peer_id, msg.token)
        accused = self.tracker.by_url(msg.accused_url)
        if accused is None:
            return _json({"action": "none", "why": "not a current peer"})
        action = await self._judge(reporter.peer_id, accused.peer_id, msg)
        return _json({"action": action})

    async def _judge(self, reporter: str, accused: str, msg: Report) -> str:
        """Act on a report only as far as we can confirm it ourselves: reporters are untrusted too."""
        assert self.tracker and self._session
        t = self.tracker
        rec = t.peers.get(accused)
        if rec is None:
            return "already gone"
        if msg.reason == "corrupt":
            verdict = await self._probe_piece(msg.accused_url, msg.version, msg.piece)
            if verdict == "corrupt":
                t.ban(accused, f"served corrupt piece {msg.piece} of v{msg.version} (confirmed by origin)", reporter)
                return "banned"
            if verdict == "dead":
                t.remove(accused, f"unreachable after corrupt report by {reporter}")
                return "removed"
            # Not reproducible: could be targeted corruption or a lying reporter; two independent reporters ban.
            rec.reporters.add(reporter)
            rec.strikes += 1
            if len(rec.reporters) >= 2:
                t.ban(accused, f"corrupt data reported by {sorted(rec.reporters)}", reporter)
                return "banned"
            t.event(f"unconfirmed corrupt report on {accused} by {reporter}")
            return "noted"
        if not await self._probe_health(msg.accused_url):
            t.remove(accused, f"{msg.reason} reported by {reporter}, health probe failed")
            return "removed"
        rec.reporters.add(reporter)
        rec.strikes += 1
        if msg.reason == "stall" and len(rec.reporters) >= 2:
            t.demote(accused, f"stalls reported by {sorted(rec.reporters)}")
            return "demoted"
        t.event(f"{msg.reason} report on {accused} by {reporter}, but it answers health checks")
        return "noted"

    async def _probe_health(self, url: str) -> bool:
        assert self._session
        try:
            async with self._session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _probe_piece(self, url: str, version: int, index: int) -> str:
        st = self.versions.get(version)
        if st is None or not 0 <= index < len(st.pieces):
            return "unknown"
        ref = st.pieces[index]
        assert self._session
        try:
            async with self._session.get(
                f"{url}/v/{version}/piece/{index}", timeout=aiohttp.ClientTimeout(total=10)
            ) as r:
                if r.status != 200:
                    return "unknown"
                data = await read_capped(r.content, ref.size)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return "dead"
        return "ok" if ref.matches(data) else "corrupt"

    async def _latest(self, request: web.Request) -> web.Response:
        """Long poll: answers at once if something newer than `after` exists, else when it is published."""
        after = request.query.get("after", "")
        wait = min(float(request.query.get("wait", "0") or 0), 60.0)
        if after and after.lstrip("-").isdigit():
            a = int(after)
            try:
                async with asyncio.timeout(wait), self._new_version:
                    await self._new_version.wait_for(
                        lambda: self._closing or (self.latest is not None and self.latest > a))
            except TimeoutError:
                pass
        return _json(Latest(self.latest, sorted(self.versions)))

    async def _tree(self, request: web.Request) -> web.Response:
        assert self.tracker
        return _json(self.tracker.view(self.latest, sorted(self.versions)))

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"ok": True, "role": "origin"})

    async def _info(self, request: web.Request) -> web.Response:
        return _json({"public_key": self.keypair.public_hex, "fingerprint": self.keypair.fingerprint,
                      "trees": self.trees, "fanout": self.fanout, "started": time.time()})

    async def _manifest(self, request: web.Request) -> web.Response:
        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        st = self.versions.get(version)
        if st is None:
            raise web.HTTPNotFound(text=f"version {version} not available (retired or never published)")
        return web.Response(body=encode_manifest(st.manifest), content_type="application/json")

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        async def lookup(v: int) -> VersionState | None:
            return self.versions.get(v)

        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        index = request.match_info["index"]
        order = self._order.get(version)
        if order is None or not index.isdigit() or int(index) >= len(order.sent):
            return await serve_piece(request, lookup, self.limiter, self.piece_wait)
        await order.wait_turn(int(index))
        try:
            return await serve_piece(request, lookup, self.limiter, self.piece_wait)
        finally:
            await order.sent_one(int(index))


def _status(status: int, text: str) -> web.HTTPException:
    cls = {400: web.HTTPBadRequest, 403: web.HTTPForbidden, 404: web.HTTPNotFound, 410: web.HTTPGone}
    return cls.get(status, web.HTTPBadRequest)(text=text)


def _valid_url(url: str) -> bool:
    from yarl import URL

    try:
        u = URL(url)
    except ValueError:
        return False
    return u.scheme == "http" and bool(u.host) and u.port is not None and u.path in ("", "/") and len(url) < 256

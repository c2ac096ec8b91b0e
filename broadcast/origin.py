"""The origin: tracker + root seed in one aiohttp app, embeddable in the trainer's own event loop."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

from swarm_common.atomic import write_atomic
from swarm_common.http import start_site
from swarm_common.keys import KeyPair

from .addresses import advertised_url, is_private, relay_url
from .config import OriginConfig
from .delta_publish import build_version, serve_file, want_delta
from .identity import JOIN_SKEW_S, check_join
from .judge import Judge, Prober
from .manifest import Manifest, auto_piece_size, encode_manifest
from .messages import MAX_TRACKER_MESSAGE_BYTES, Join, Latest, Leave, PeerHeartbeat, ReachTest, Report, decode
from .ratelimit import KeyedBuckets, RateLimiter
from .release import InOrderRelease
from .serving import MAX_VERSION, Turns, parse_int, serve_piece
from .store import VersionState
from .tracker import Tracker, TrackerError
from .uplink_probe import UPLINKS_FILE, UplinkProber

log = logging.getLogger("broadcast.origin")


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


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
        self._judge: Judge | None = None
        self._prober: Prober | None = None
        self._uplinks: UplinkProber | None = None  # times relays' uplinks before any child has
        self._join_limit, self._key_limit = KeyedBuckets(*cfg.joins_per_address), KeyedBuckets(*cfg.joins_per_key)
        self._report_limit = KeyedBuckets(1.0, 5.0)  # keys with standing
        self._fresh_report_limit = KeyedBuckets(0.2, 3.0)  # keys without: a report costs the origin a probe
        self._doctor_limit = KeyedBuckets(0.5, 3.0)
        # once an interval, and at once after a report or a version: more only costs the trainer's CPU
        self._hb_limit = KeyedBuckets(4.0 / cfg.heartbeat_s, 12.0)
        self._nonces: dict[str, float] = {}
        self._trusted: set[str] = set()  # keys the trainer calls established, kept across tracker restarts
        self._new_version = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._url: str | None = None
        self._closing = False
        self._order: dict[int, InOrderRelease] = {}  # per version: its pieces leave about in order
        self._turns = Turns()  # serving.py: a child's requests take turns

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
                web.get("/reach-test", self._reach_test),
                web.get("/latest", self._latest),
                web.get("/tree", self._tree),
                web.get("/health", self._health),
                web.get("/info", self._info),
                web.get("/v/{version}/manifest", self._manifest),
                web.get("/v/{version}/piece/{index}", self._piece),
                web.get("/v/{version}/file/{path:.+}", self._file),
            ]
        )
        # Short shutdown: long polls and held piece requests must not keep stop() waiting.
        self._runner, self.port = await start_site(app, self.host, self.port, shutdown_timeout=1.0)
        self._url = f"http://{self.host}:{self.port}"
        self.tracker = Tracker(self._url, self.trees, self.fanout, self.cfg.heartbeat_s, max_peers=self.cfg.max_peers)
        for key in self._trusted:
            self.tracker.set_trusted(key)
        self.tracker.uploads.restore(self.root_dir / UPLINKS_FILE)  # a restarted trainer's swarm: no re-probing
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                              connector=aiohttp.TCPConnector(limit=64, force_close=True))
        self._prober = Prober(self._session)
        self._judge = Judge(self.tracker, self._prober, lambda: self.versions, self._banned_here)
        self._uplinks = UplinkProber(self.tracker, self._session, self._spawn)
        self._tasks.append(asyncio.create_task(self._reaper()))
        log.info("origin at %s, trainer key %s, %d trees, fanout %d", self._url, self.keypair.fingerprint,
                 self.trees, self.fanout)

    async def stop(self) -> None:
        self._closing = True
        async with self._new_version:
            self._new_version.notify_all()  # release long polls now
        pending = [*self._tasks, *(self._judge.tasks if self._judge else ())]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._tasks.clear()
        if self._session:
            await self._session.close()
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
        self._order[version] = InOrderRelease(m.n_pieces, 2 * self.trees)
        self.latest = version
        self._retention()
        assert self.tracker
        await asyncio.to_thread(write_atomic, self.root_dir / UPLINKS_FILE, self.tracker.uploads.dump())
        kind = f"delta against v{m.base}" if m.base is not None else "whole"
        self.tracker.event(f"publish v{version} {kind} ({m.total_size} bytes, {m.n_pieces} pieces)")
        async with self._new_version:
            self._new_version.notify_all()
        return m

    def _retention(self) -> None:
        # Stop serving all but the newest `keep`; delete only directories that live under our root_dir.
        for v in sorted(self.versions)[: -self.keep]:
            st = self.versions.pop(v)
            self.full_dirs.pop(v, None)
            self._order.pop(v, None)
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
            assert self.tracker and self._judge
            self.tracker.reap()
            now = time.monotonic()
            # Unreachable relays are re-checked now and then: a port opened later makes one a relay again.
            for rec in [p for p in self.tracker.peers.values() if p.relay and p.reachable is False][:2]:
                if now - rec.rechecked > 30.0:
                    rec.rechecked = now
                    self._spawn(self._judge.recheck_reach(rec))

    def _spawn(self, coro) -> None:
        assert self._judge
        task = asyncio.create_task(coro)
        self._judge.tasks.add(task)
        task.add_done_callback(self._judge.tasks.discard)

    # -- handlers ---------------------------------------------------------------------------------------
    async def _body(self, request: web.Request, typ: type):
        try:
            return decode(await request.read(), typ)
        except (msgspec.DecodeError, ValueError) as e:
            assert self.tracker
            self.tracker.count("malformed")
            raise web.HTTPBadRequest(text=f"bad {typ.__name__}: {e}") from e

    def _tracker_call(self, fn, *args):
        try:
            return fn(*args)
        except TrackerError as e:
            raise _status(e.status, str(e)) from e

    def _relay_url(self, msg: Join, request: web.Request) -> str | None:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        private_ok = self.cfg.private_ok
        if private_ok is None:
            private_ok = bool(sock) and is_private(str(sock[0]))
        try:
            return advertised_url(msg.relay, msg.url, msg.port, request.remote or "", private_ok)
        except ValueError as e:
            code = "private_url" if "private" in str(e) else "bad_url"
            raise TrackerError(400, str(e), code) from None

    def _check_signed(self, msg: Join, src: str) -> None:
        if wait := self._join_limit.take(src):
            raise TrackerError(429, f"too many joins from {src}: retry in {wait:.1f}s", "rate_limited")
        if why := check_join(msg):
            raise TrackerError(403 if why == "bad signature" else 400, f"join refused: {why}",
                               "bad_signature" if why == "bad signature" else "bad_join")
        now = time.monotonic()
        if msg.nonce in self._nonces:
            raise TrackerError(400, "join refused: this signed join was already used (replay)", "replayed_join")
        if len(self._nonces) > 50_000:
            self._nonces = {n: t for n, t in self._nonces.items() if t > now}
        self._nonces[msg.nonce] = now + 2 * JOIN_SKEW_S
        if wait := self._key_limit.take(msg.key):
            raise TrackerError(429, f"too many joins by key {msg.key[:16]}...: retry in {wait:.1f}s", "rate_limited")

    async def _join(self, request: web.Request) -> web.Response:
        src = request.remote or "?"
        msg: Join = await self._body(request, Join)
        assert self.tracker and self._prober
        t = self.tracker
        try:
            self._check_signed(msg, src)
            url = self._relay_url(msg, request)
            t.check_admission(msg.key, url)
            reachable, err = None, ""
            if url is not None:
                # Checked, not believed: the peer at that address must sign our nonce with the joining key.
                status, _, detail = await self._prober.reach(url, msg.key)
                if status == "mismatch":
                    raise TrackerError(403, f"join refused: {detail}", "connect_back_mismatch")
                reachable, err = status == "ok", "" if status == "ok" else detail
                if not reachable:
                    t.count("unreachable")
                holder = t.url_holder(url, msg.key)
                if holder is not None and reachable:  # it answers there for the new key: the old record is stale
                    t.remove(holder.peer_id, f"its address {url} now answers for another key")
                elif holder is not None:
                    raise TrackerError(409, f"join refused: {url} is held by another live peer", "url_taken")
            joined = t.join(msg, key=msg.key, url=url, reachable=reachable, reach_error=err, observed_host=src)
        except TrackerError as e:
            t.count(e.reason)
            log.warning("join from %s (key %s) refused: %s", src, msg.key[:16], e)
            resp = _status(e.status, str(e))
            if e.status == 429:
                resp.headers["Retry-After"] = "1"
            raise resp from None
        return _json(joined)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        msg: PeerHeartbeat = await self._body(request, PeerHeartbeat)
        assert self.tracker and self._judge and self._uplinks
        if msg.peer_id in self.tracker.peers and (wait := self._hb_limit.take(msg.peer_id)):
            self.tracker.count("rate_limited")
            raise web.HTTPTooManyRequests(text=f"heartbeats come once per interval: retry in {wait:.1f}s")
        out = self._tracker_call(self.tracker.heartbeat, msg, self.latest)
        self._judge.maybe_prove(self.tracker.peers[msg.peer_id])
        self._uplinks.after_heartbeat(self.tracker.peers[msg.peer_id])
        return _json(out.for_peer(msg.sources_tag))

    async def _leave(self, request: web.Request) -> web.Response:
        msg: Leave = await self._body(request, Leave)
        assert self.tracker
        self._tracker_call(self.tracker.auth, msg.peer_id, msg.token)
        self.tracker.remove(msg.peer_id, "left")
        return _json({"ok": True})

    async def _report(self, request: web.Request) -> web.Response:
        msg: Report = await self._body(request, Report)
        assert self.tracker and self._judge
        t = self.tracker
        reporter = self._tracker_call(t.auth, msg.peer_id, msg.token)
        if t.points(reporter.key) > t.penalty_limit - 1:
            t.count("ignored_report")
            raise web.HTTPForbidden(text="your recent reports could not be confirmed: reports ignored for a while")
        limit = self._report_limit if t.has_standing(reporter) else self._fresh_report_limit
        if wait := limit.take(reporter.key):
            t.count("rate_limited")
            raise web.HTTPTooManyRequests(text=f"too many reports: retry in {wait:.1f}s")
        accused = self.tracker.by_url(msg.accused_url)
        if accused is None or accused is reporter:
            return _json({"action": "none", "why": "not a current peer"})
        action = await self._judge.judge(reporter, accused, msg)
        return _json({"action": action})

    async def _reach_test(self, request: web.Request) -> web.Response:
        """For `swarm doctor`: connect back to ?port=P at the address the request came from, say what answered."""
        src = request.remote or ""
        port = request.query.get("port", "")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise web.HTTPBadRequest(text="?port= must be a port number 1-65535")
        if wait := self._doctor_limit.take(src):
            raise web.HTTPTooManyRequests(text=f"one connect-back test every 2s per address: retry in {wait:.1f}s")
        assert self._prober
        url = relay_url(src, int(port))
        status, key, detail = await self._prober.reach(url, None)
        reachable = status in ("ok", "not_relay")
        return _json(ReachTest(src, url, reachable, key if status == "ok" else None, detail))

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

    async def _file(self, request: web.Request) -> web.StreamResponse:
        return await serve_file(request, {v: st.manifest for v, st in self.versions.items()}, self.full_dirs,
                                self.limiter)

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        async def lookup(v: int) -> VersionState | None:
            return self.versions.get(v)
        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        index = request.match_info["index"]
        order = self._order.get(version)
        if order is None or not index.isdigit() or int(index) >= len(order.sent):
            return await serve_piece(request, lookup, self.limiter, self.cfg.piece_wait_s, self._turns, self.trees)
        await order.wait_turn(int(index))
        try:
            return await serve_piece(request, lookup, self.limiter, self.cfg.piece_wait_s, self._turns, self.trees)
        finally:
            await order.sent_one(int(index))


def _status(status: int, text: str) -> web.HTTPException:
    cls = {400: web.HTTPBadRequest, 403: web.HTTPForbidden, 404: web.HTTPNotFound, 409: web.HTTPConflict,
           410: web.HTTPGone, 429: web.HTTPTooManyRequests, 503: web.HTTPServiceUnavailable}
    return cls.get(status, web.HTTPBadRequest)(text=text)

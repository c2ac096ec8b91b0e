"""The origin's HTTP routes: the tracker's (join, heartbeat, report, leave, latest, tree, the doctor's
reach test) and the root seed's (manifests, pieces in about index order, a delta version's files whole).
Each request is bounded, validated and rate-limited here; what it means is the tracker's (tracker.py) and
the judge's (verdicts.py); the versions are the origin's (origin.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
from aiohttp import web

from .addresses import advertised_url, is_private, relay_url
from .admission import JoinGate
from .buckets import KeyedBuckets
from .delta_publish import serve_file
from .identity import JOIN_SKEW_S, check_join
from .manifest import encode_manifest
from .messages import MAX_TRACKER_MESSAGE_BYTES, Join, Latest, Leave, PeerHeartbeat, ReachTest, Report, decode
from .piece_pass import PASS_HEADER, PEER_HEADER, PieceGate, file_name, piece_name
from .serving import MAX_VERSION, parse_int, serve_piece
from .store import VersionState
from .tracker import TrackerError
from .uplink_share import FirstAnswer, UplinkShare
from .verdicts import ReportGate

if TYPE_CHECKING:
    from swarm_common.keys import KeyPair

    from .config import OriginConfig
    from .judge import Judge, Prober
    from .ratelimit import RateLimiter
    from .release import InOrderRelease
    from .serving import Turns
    from .tracker import Tracker
    from .uplink_probe import UplinkProber

log = logging.getLogger("broadcast.origin")


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


class Served(Protocol):
    """What the routes ask of the origin (origin.Origin): its tracker and judge, and the versions it serves."""

    cfg: OriginConfig
    keypair: KeyPair
    trees: int
    fanout: int
    tracker: Tracker | None
    judge: Judge | None
    prober: Prober | None
    uplinks: UplinkProber | None
    latest: int | None
    versions: dict[int, VersionState]
    full_dirs: dict[int, Path]
    order: dict[int, InOrderRelease]
    turns: Turns
    share: UplinkShare
    limiter: RateLimiter
    new_version: asyncio.Condition
    closing: bool


class OriginRoutes:
    def __init__(self, origin: Served):
        self.origin = origin
        cfg = origin.cfg
        self.joins = JoinGate(cfg)
        self.reports = ReportGate()
        self.pieces = PieceGate()
        self.doctor_limit = KeyedBuckets(0.5, 3.0)
        # /tree grows with the swarm (24 KB at 32 members) and leaves on the uplink that feeds every tree:
        # across namespaces, 5 attacker addresses polling it 3 times a second took ~70% of a 4 Mbit/s origin.
        self.view_limit = KeyedBuckets(2.0, 10.0)
        # once an interval, and at once after a report or a version: more only costs the trainer's CPU
        self.hb_limit = KeyedBuckets(4.0 / cfg.heartbeat_s, 12.0)
        self.nonces: dict[str, float] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_TRACKER_MESSAGE_BYTES)
        app.add_routes([
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
        ])
        return app

    async def _body(self, request: web.Request, typ: type):
        try:
            return decode(await request.read(), typ)
        except (msgspec.DecodeError, ValueError) as e:
            assert self.origin.tracker
            self.origin.tracker.count("malformed")
            raise web.HTTPBadRequest(text=f"bad {typ.__name__}: {e}") from e

    def _tracker_call(self, fn, *args):
        try:
            return fn(*args)
        except TrackerError as e:
            raise _status(e.status, str(e)) from e

    def _relay_url(self, msg: Join, request: web.Request) -> str | None:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        private_ok = self.origin.cfg.private_ok
        if private_ok is None:
            private_ok = bool(sock) and is_private(str(sock[0]))
        try:
            return advertised_url(msg.relay, msg.url, msg.port, request.remote or "", private_ok)
        except ValueError as e:
            code = "private_url" if "private" in str(e) else "bad_url"
            raise TrackerError(400, str(e), code) from None

    def _check_signed(self, msg: Join, src: str) -> None:
        self.joins.address(src, time.monotonic())
        if why := check_join(msg):
            raise TrackerError(403 if why == "bad signature" else 400, f"join refused: {why}",
                               "bad_signature" if why == "bad signature" else "bad_join")
        now = time.monotonic()
        if msg.nonce in self.nonces:
            raise TrackerError(400, "join refused: this signed join was already used (replay)", "replayed_join")
        if len(self.nonces) > 50_000:
            self.nonces = {n: t for n, t in self.nonces.items() if t > now}
        self.nonces[msg.nonce] = now + 2 * JOIN_SKEW_S
        assert self.origin.tracker
        self.joins.signed(src, msg.key, self.origin.tracker.standing.ranked(msg.key), now)

    async def _join(self, request: web.Request) -> web.Response:
        src = request.remote or "?"
        msg: Join = await self._body(request, Join)
        assert self.origin.tracker and self.origin.prober
        t = self.origin.tracker
        try:
            self._check_signed(msg, src)
            url = self._relay_url(msg, request)
            t.check_admission(msg.key, url)
            reachable, err = None, ""
            if url is not None:
                # Checked, not believed: the peer at that address must sign our nonce with the joining key.
                status, _, detail = await self.origin.prober.reach(url, msg.key)
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
        assert self.origin.tracker and self.origin.judge and self.origin.uplinks
        if msg.peer_id in self.origin.tracker.peers and (wait := self.hb_limit.take(msg.peer_id, time.monotonic())):
            self.origin.tracker.count("rate_limited")
            raise web.HTTPTooManyRequests(text=f"heartbeats come once per interval: retry in {wait:.1f}s")
        out = self._tracker_call(self.origin.tracker.heartbeat, msg, self.origin.latest)
        self.origin.judge.maybe_prove(self.origin.tracker.peers[msg.peer_id])
        self.origin.uplinks.after_heartbeat(self.origin.tracker.peers[msg.peer_id])
        return _json(out.for_peer(msg.sources_tag))

    async def _leave(self, request: web.Request) -> web.Response:
        msg: Leave = await self._body(request, Leave)
        assert self.origin.tracker
        self._tracker_call(self.origin.tracker.auth, msg.peer_id, msg.token)
        self.origin.tracker.remove(msg.peer_id, "left")
        return _json({"ok": True})

    async def _report(self, request: web.Request) -> web.Response:
        msg: Report = await self._body(request, Report)
        assert self.origin.tracker and self.origin.judge
        t = self.origin.tracker
        reporter = self._tracker_call(t.auth, msg.peer_id, msg.token)
        refused = self.reports.refusal(t, reporter)
        if refused is not None:
            raise _status(*refused)
        accused = t.by_url(msg.accused_url)
        if accused is None or accused is reporter:
            return _json({"action": "none", "why": "not a current peer"})
        action = await self.origin.judge.judge(reporter, accused, msg)
        return _json({"action": action})

    async def _reach_test(self, request: web.Request) -> web.Response:
        """For `swarm doctor`: connect back to ?port=P at the address the request came from, say what answered."""
        src = request.remote or ""
        port = request.query.get("port", "")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise web.HTTPBadRequest(text="?port= must be a port number 1-65535")
        if wait := self.doctor_limit.take(src, time.monotonic()):
            raise web.HTTPTooManyRequests(text=f"one connect-back test every 2s per address: retry in {wait:.1f}s")
        assert self.origin.prober
        url = relay_url(src, int(port))
        status, key, detail = await self.origin.prober.reach(url, None)
        reachable = status in ("ok", "not_relay")
        return _json(ReachTest(src, url, reachable, key if status == "ok" else None, detail))

    async def _latest(self, request: web.Request) -> web.Response:
        """Long poll: answers at once if something newer than `after` exists, else when it is published."""
        after = request.query.get("after", "")
        wait = min(float(request.query.get("wait", "0") or 0), 60.0)
        if after and after.lstrip("-").isdigit():
            a = int(after)
            try:
                async with asyncio.timeout(wait), self.origin.new_version:
                    await self.origin.new_version.wait_for(
                        lambda: self.origin.closing or (self.origin.latest is not None and self.origin.latest > a))
            except TimeoutError:
                pass
        return _json(Latest(self.origin.latest, sorted(self.origin.versions)))

    async def _tree(self, request: web.Request) -> web.Response:
        assert self.origin.tracker
        if wait := self.view_limit.take(request.remote or "?", time.monotonic()):
            self.origin.tracker.count("rate_limited")
            raise web.HTTPTooManyRequests(text=f"/tree: at most {self.view_limit.rate:g} a second per address: retry in {wait:.1f}s",
                                          headers={"Retry-After": str(max(1, round(wait)))})
        return _json(self.origin.tracker.view(self.origin.latest, sorted(self.origin.versions)))

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"ok": True, "role": "origin"})

    async def _info(self, request: web.Request) -> web.Response:
        return _json({"public_key": self.origin.keypair.public_hex, "fingerprint": self.origin.keypair.fingerprint,
                      "trees": self.origin.trees, "fanout": self.origin.fanout, "started": time.time()})

    async def _manifest(self, request: web.Request) -> web.Response:
        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        st = self.origin.versions.get(version)
        if st is None:
            raise web.HTTPNotFound(text=f"version {version} not available (retired or never published)")
        return web.Response(body=encode_manifest(st.manifest), content_type="application/json")

    def _members_only(self, request: web.Request, name: str, trial: bool = True) -> None:
        """Pieces and files go to the swarm's members (piece_pass.py); a stranger's pieces to its trial."""
        if (t := self.origin.tracker) is None:
            return
        src = request.remote or "?"
        if not self.pieces.admits(t.peers, request.headers.get(PEER_HEADER, ""), request.headers.get(PASS_HEADER, ""),
                                  name, src, time.monotonic(), trial):
            t.count("piece_refused")
            log.debug("%s refused to %s: not a member", name, src)
            raise web.HTTPForbidden(text="pieces are served to the swarm's members: join it with "
                                    "`swarm node --trainer HOST:PORT`")

    async def _file(self, request: web.Request) -> web.StreamResponse:
        self._members_only(request, file_name(request.match_info["version"], request.match_info["path"]), trial=False)
        return await serve_file(request, {v: st.manifest for v, st in self.origin.versions.items()}, self.origin.full_dirs,
                                self.origin.limiter)

    async def _piece(self, request: web.Request) -> web.StreamResponse:
        async def lookup(v: int) -> VersionState | None:
            return self.origin.versions.get(v)
        version = parse_int(request.match_info["version"], MAX_VERSION, "version")
        index = request.match_info["index"]
        self._members_only(request, piece_name(version, index))
        # Admitted: a member (its pass checked) or a stranger's trial; only members placed above the rest
        # are sent to first (uplink_share.py).
        o, t, who = self.origin, self.origin.tracker, request.headers.get(PEER_HEADER, "")
        piece = int(index) if index.isascii() and index.isdigit() and len(index) < 12 else None  # (serve_piece checks it)
        first = FirstAnswer(o.share, who) if t is None or t.line.first(who, piece) else None
        pace = None if first else o.share.low_sent
        order = o.order.get(version)
        try:
            if order is None or piece is None or piece >= len(order.sent):
                return await serve_piece(request, lookup, o.limiter, o.cfg.piece_wait_s, o.turns, o.trees, first, pace)
            await order.wait_turn(piece)
            try:
                return await serve_piece(request, lookup, o.limiter, o.cfg.piece_wait_s, o.turns, o.trees, first, pace)
            finally:
                await order.sent_one(piece)
        finally:
            if first:
                first.done()


def _status(status: int, text: str) -> web.HTTPException:
    cls = {400: web.HTTPBadRequest, 403: web.HTTPForbidden, 404: web.HTTPNotFound, 409: web.HTTPConflict,
           410: web.HTTPGone, 429: web.HTTPTooManyRequests, 503: web.HTTPServiceUnavailable}
    return cls.get(status, web.HTTPBadRequest)(text=text)

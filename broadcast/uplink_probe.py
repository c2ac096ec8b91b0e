"""The origin times a download from a relay, to place it by uplink before any child has measured it.

Without it a new swarm's first version ran on the join-order layout, slow home relays inside the trees:
in the 1000-peer simulation a 13.5 MB version took 25-215 s against a bound near 1.1 s; laid out by the
probes, 4.9-6.3 s (docs/tree-simulation.md, item 7).

A relay with standing (placement counts no fresh key's numbers) that no child has measured yet is asked,
after a heartbeat, for PROBE_BYTES of filler at GET /probe; the origin times it from sending the request to
the last byte. One stream, so at most the relay's uplink: a lower bound (the connection's and the request's
round trips, TCP's slow start at long round trips, and the origin's downlink shared by the probes in
flight all lower it), replaced by the children's figure once the relay carries a version
(placement.UploadMeter). Only the tracker may ask: the request carries an HMAC of the peer's join token,
which only the tracker and the peer know, so strangers cannot spend a relay's uplink on probes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

if TYPE_CHECKING:
    from .ratelimit import RateLimiter
    from .tracker import PeerRec, Tracker

log = logging.getLogger("broadcast.uplink_probe")
PROBE_PATH = "/probe"
PROBE_BYTES = 1 << 20
HEADER = "X-Probe-Auth"
UPLINKS_FILE = "uplinks.json"  # in the origin's directory: the figures kept across its restarts
MAX_IN_FLIGHT = 16  # probes at once; they share the origin's downlink: at 1 Gbit/s, ~60 Mbit/s each
RETRY_S = 60.0  # a probe that failed (busy, timed out, refused) is tried again this much later
TIMEOUT_S = 30.0
_FILLER = bytes(64 << 10)


def probe_auth(token: str) -> str:
    return hmac.new(token.encode(), b"rollout-swarm/uplink-probe/v1", hashlib.sha256).hexdigest()


def wants_probe(tracker: Tracker, rec: PeerRec) -> bool:
    """A relay whose uplink placement would use, that nothing has measured yet, and whose uplink is idle:
    no version is in flight, or it has no children now (a leaf uploads nothing). A probe of a relay that is
    serving measures its children's share and takes time from them: in the simulation, probes during a
    version measured such relays at a fifth of their uplink and slowed the version."""
    if (rec.reachable is not True or not rec.interior_capable or not tracker.has_standing(rec)  # capable: has a url
            or rec.url in tracker.uploads.estimate or rec.url in tracker.uploads.probed):
        return False
    if not tracker.in_flight():
        return True
    children = tracker.topology()[1]
    return not any(children[t].get(rec.peer_id) for t in range(tracker.trees))


class Preempted(Exception):
    """A version went out during the probe and the relay now serves it: its uplink is its children's."""


class ProbeServer:
    """The relay's side: PROBE_BYTES of filler, paced by its upload limit, one probe at a time."""

    def __init__(self, limiter: RateLimiter, token: Callable[[], str]) -> None:
        self.limiter, self.token = limiter, token
        self._busy = False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        token = self.token()
        if not token or not hmac.compare_digest(request.headers.get(HEADER, ""), probe_auth(token)):
            raise web.HTTPForbidden(text="uplink probes are the tracker's, signed with this peer's join token")
        if self._busy:
            raise web.HTTPTooManyRequests(text="a probe is in progress")
        self._busy = True
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = PROBE_BYTES
        try:
            await resp.prepare(request)
            step = 16 << 10 if self.limiter.rate else len(_FILLER)  # paced as pieces are (serving._send)
            for k in range(0, PROBE_BYTES, step):
                n = min(step, PROBE_BYTES - k)
                await self.limiter.acquire(n)
                await resp.write(_FILLER[:n])
            await resp.write_eof()
        except ConnectionError:  # the origin gave the probe up (a version went out): nothing to report
            pass
        finally:
            self._busy = False
        return resp


class UplinkProber:
    """The origin's side: after a heartbeat, probe the relays that `wants_probe`, a few at a time."""

    def __init__(self, tracker: Tracker, session: aiohttp.ClientSession, spawn) -> None:
        self.tracker, self.session, self.spawn = tracker, session, spawn
        self._sem = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._pending: set[str] = set()  # keys queued or being probed
        self._retry: dict[str, float] = {}  # key -> when a failed probe may be tried again
        self.counts = {"probed": 0, "failed": 0, "preempted": 0}

    def after_heartbeat(self, rec: PeerRec) -> None:
        now = time.monotonic()
        if rec.key in self._pending or self._retry.get(rec.key, 0.0) > now or not wants_probe(self.tracker, rec):
            return
        self._pending.add(rec.key)
        self.spawn(self._probe(rec))

    async def _probe(self, rec: PeerRec) -> None:
        url, token = rec.url, rec.token
        try:
            async with self._sem:
                if self.tracker.peers.get(rec.peer_id) is not rec or not wants_probe(self.tracker, rec):
                    return  # it left, or serves a version that went out meanwhile: asked after a later heartbeat
                rate = await self.time_download(f"{url}{PROBE_PATH}", probe_auth(token), rec)
        except Preempted:
            self.counts["preempted"] += 1
            return
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            self.counts["failed"] += 1
            log.debug("uplink probe of %s failed (tried again in %.0fs): %s", url, RETRY_S, e)
            self._retry[rec.key] = time.monotonic() + RETRY_S
            if len(self._retry) > 4 * self.tracker.max_peers:
                self._retry = {k: t for k, t in self._retry.items() if t > time.monotonic()}
            return
        finally:
            self._pending.discard(rec.key)
        if self.tracker.peers.get(rec.peer_id) is rec and rec.url == url:
            self.tracker.probed(rec, rate)
            self.counts["probed"] += 1
            log.debug("uplink probe of %s: %.1f Mbit/s", url, rate * 8 / 1e6)

    async def time_download(self, url: str, auth: str, rec: PeerRec | None = None) -> float:
        """Bytes/s from sending the request to the body's last byte: a lower bound whatever else this
        process is doing (timing only part of the body read 1.26x a link's rate on a loaded machine, the
        bytes that waited in the socket while the event loop was busy counted as quick). `rec`: given up
        (Preempted) if a version goes out meanwhile and gives that relay children."""
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S, sock_connect=5.0, sock_read=10.0)
        latest, t0, got = self.tracker.latest, time.monotonic(), 0
        async with self.session.get(url, headers={HEADER: auth}, timeout=timeout) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}: {(await r.content.read(200)).decode(errors='replace')}")
            async for chunk in r.content.iter_any():
                if rec is not None and self.tracker.latest != latest:
                    latest = self.tracker.latest
                    if not wants_probe(self.tracker, rec):
                        raise Preempted
                got += len(chunk)
                if got > PROBE_BYTES:
                    raise ValueError("more bytes than a probe has")
            elapsed = time.monotonic() - t0
        if got < PROBE_BYTES:
            raise ValueError(f"the body ended after {got} of {PROBE_BYTES} bytes")
        return got / max(elapsed, 1e-3)

"""The origin times a download from a relay, to place it by uplink before any child has measured it.

Without it a new swarm's first version ran on the join-order layout, slow home relays inside the trees:
in the 1000-peer simulation a 13.5 MB version took 25-215 s against a bound near 1.1 s; laid out by the
probes, 4.9-6.3 s (docs/tree-simulation.md, item 7).

A relay with standing (placement counts no fresh key's numbers) that no child has measured yet is asked,
after a heartbeat, for PROBE_BYTES of filler at GET /probe; the origin times it from sending the request to
the last byte (or reads for PROBE_MAX_S, then closes). One stream, so at most the relay's uplink: a lower
bound (the connection's and the request's round trips, TCP's slow start at long round trips, and the
origin's downlink shared by the probes in flight all lower it; uplink_plan.py times again the figures held
to a share), replaced by the children's figure once the relay carries a version
(upload_meter.UploadMeter). Only the tracker may ask: the request carries an HMAC of the peer's join token,
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

from .uplink_plan import PROBE_BYTES, PROBE_MAX_S, RETRY_S, TIMEOUT_S, UplinkPlan

if TYPE_CHECKING:
    from .ratelimit import RateLimiter
    from .tracker import PeerRec, Tracker

log = logging.getLogger("broadcast.uplink_probe")
PROBE_PATH = "/probe"
HEADER = "X-Probe-Auth"
UPLINKS_FILE = "uplinks.json"  # in the origin's directory: the figures kept across its restarts
_FILLER = bytes(64 << 10)
BUSY_RETRY_S = 0.25


def probe_auth(token: str) -> str:
    return hmac.new(token.encode(), b"rollout-swarm/uplink-probe/v1", hashlib.sha256).hexdigest()


class Busy(ValueError):
    """The relay answers another probe (the one the origin stopped reading a moment ago)."""


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
                if request.transport is None or request.transport.is_closing():
                    break  # the origin stopped reading (PROBE_MAX_S): the uplink is free again at once
                await resp.write(_FILLER[:n])
            else:
                await resp.write_eof()
        except ConnectionError:  # the origin gave the probe up (a version went out): nothing to report
            pass
        finally:
            self._busy = False
        return resp


class UplinkProber:
    """The origin's side: after a heartbeat, probe the relays the plan (uplink_plan.py) says, a few at a time."""

    def __init__(self, tracker: Tracker, session: aiohttp.ClientSession, spawn) -> None:
        self.tracker, self.session, self.spawn = tracker, session, spawn
        self.plan = UplinkPlan(tracker)

    @property
    def counts(self) -> dict[str, int]:
        return self.plan.counts

    def after_heartbeat(self, rec: PeerRec) -> None:
        self._start(self.plan.after_heartbeat(rec))

    def _start(self, recs: list[PeerRec]) -> None:
        for rec in recs:
            self.spawn(self._probe(rec))

    async def _probe(self, rec: PeerRec) -> None:
        url, token, rate, outcome = rec.url or "", rec.token, 0.0, "failed"
        try:
            try:
                rate = await self.time_download(f"{url}{PROBE_PATH}", probe_auth(token), rec)
            except Busy:  # the probe just stopped may still be winding down there
                await asyncio.sleep(BUSY_RETRY_S)
                rate = await self.time_download(f"{url}{PROBE_PATH}", probe_auth(token), rec)
            outcome = "probed"
            log.debug("uplink probe of %s: %.1f Mbit/s", url, rate * 8 / 1e6)
        except Preempted:
            outcome = "preempted"
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            log.debug("uplink probe of %s failed (tried again in %.0fs): %s", url, RETRY_S, e)
        finally:
            self._start(self.plan.done(rec, url, outcome, rate))

    async def time_download(self, url: str, auth: str, rec: PeerRec | None = None) -> float:
        """Bytes/s from sending the request to the body's last byte, or to PROBE_MAX_S: a lower bound whatever
        else this process is doing (timing only part of the body read 1.26x a link's rate on a loaded
        machine, the bytes that waited in the socket while the event loop was busy counted as quick).
        `rec`: given up (Preempted) if a version goes out meanwhile and gives that relay children."""
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S, sock_connect=5.0, sock_read=10.0)
        latest, t0, got = self.tracker.latest, time.monotonic(), 0
        async with self.session.get(url, headers={HEADER: auth}, timeout=timeout) as r:
            if r.status == 429:
                raise Busy
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}: {(await r.content.read(200)).decode(errors='replace')}")
            async for chunk in r.content.iter_any():
                if rec is not None and self.tracker.latest != latest:
                    latest = self.tracker.latest
                    if self.plan.preempted(rec):
                        raise Preempted
                got += len(chunk)
                if got > PROBE_BYTES:
                    raise ValueError("more bytes than a probe has")
                if time.monotonic() - t0 >= PROBE_MAX_S:  # enough to tell: the relay sees the connection close
                    break
            elapsed = time.monotonic() - t0
        if got < PROBE_BYTES and elapsed < PROBE_MAX_S:
            raise ValueError(f"the body ended after {got} of {PROBE_BYTES} bytes")
        return got / max(elapsed, 1e-3)

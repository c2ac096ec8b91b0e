"""A peer's side of the tracker: a signed join (retried with backoff, never fatal), heartbeats, the long
poll for new versions, reports, and leaving. It owns what the tracker told this peer: its id and token, how
many trees there are, its sources in each, the address others are given for it, and whether it is evicted.

What the peer holds and what it received reach the heartbeats through `Holdings`; a new version, and
eviction, reach the peer through the callbacks it passes in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec
from yarl import URL

from swarm_common.http import read_capped
from swarm_common.keys import KeyPair, fingerprint

from .addresses import is_loopback, is_wildcard, parse_relay_url, relay_url
from .config import PeerConfig
from .errors import FetchError
from .identity import is_hex, sign_join
from .messages import Join, Joined, Latest, Leave, PeerHeartbeat, Received, Report, TreeSources, decode
from .piece_race import Report as RaceReport

log = logging.getLogger("broadcast.peer")
BACKOFF_MAX_S = 30.0
NET_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)


class Backoff:
    def __init__(self, first: float = 0.5, cap: float = BACKOFF_MAX_S):
        self.first, self.cap, self.next = first, cap, first

    def __call__(self) -> float:
        wait, self.next = self.next, min(self.cap, self.next * 2)
        return wait

    def reset(self) -> None:
        self.next = self.first


@dataclass
class Holdings:
    """What a heartbeat tells the tracker, as of now."""

    complete: list[int]
    progress: dict[int, int]
    served_bytes: int
    received: dict[str, int] = field(default_factory=dict)
    recent: dict[str, Received] = field(default_factory=dict)


class TrackerClient:
    def __init__(self, tracker_url: str, cfg: PeerConfig, keypair: KeyPair, trusted_public: bytes,
                 holdings: Callable[[], Holdings], on_latest: Callable[[int], None],
                 on_evicted: Callable[[str], None]):
        self.tracker_url, self.cfg, self.keypair = tracker_url, cfg, keypair
        self.trusted_public = trusted_public
        self.holdings, self.on_latest, self.on_evicted = holdings, on_latest, on_evicted
        self.session: aiohttp.ClientSession | None = None
        self.host = cfg.relay_host or ("127.0.0.1" if is_loopback(URL(tracker_url).host or "") else "0.0.0.0")
        self.port: int | None = None  # the relay's bound port (None: not relaying)
        self.peer_id: str | None = None
        self.token = ""
        self.trees = 1
        self.heartbeat_s = 2.0
        self.sources: list[list[str]] = [[]]  # per tree: the relays above us, parent first
        self.sources_tag = ""  # the tracker's name for them: it sends them again only when they change
        # One heartbeat at a time: an answer saying "unchanged since tag T" read after a later beat's answer
        # had moved us past T was taken for a malformed assignment (a download's start beats beside the loop).
        self._beat = asyncio.Lock()
        self.low: frozenset[str] = frozenset()  # addresses below us sent to after the others (uplink_share.py)
        self.on_trial: frozenset[str] = frozenset()  # our sources on trial (trials.py): gone around sooner
        self.url: str | None = None  # as the tracker gives it to others
        self.observed_host = ""
        self.reachable: bool | None = None
        self.leaf_only = False
        self.known_latest: int | None = None
        self.evicted: str | None = None
        self.hb_now = asyncio.Event()
        self._hb_started = self._hb_finished = 0  # heartbeats of the loop begun and done
        self._hb_done = asyncio.Condition()

    def relays(self, tree: int) -> list[str]:
        return self.sources[tree % len(self.sources)]

    async def _post(self, path: str, msg: msgspec.Struct, timeout: float = 10) -> tuple[int, bytes]:
        assert self.session
        async with self.session.post(self.tracker_url + path, data=msgspec.json.encode(msg),
                                     headers={"Content-Type": "application/json"},
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await read_capped(r.content, 1 << 20)

    # -- joining --------------------------------------------------------------------------------------
    async def _check_tracker_key(self) -> None:
        assert self.session
        async with self.session.get(self.tracker_url + "/info", timeout=aiohttp.ClientTimeout(total=5)) as r:
            info = msgspec.json.decode(await read_capped(r.content, 4096))
        theirs = info.get("public_key") if isinstance(info, dict) else None
        if theirs != self.trusted_public.hex():
            # Not fatal on its own (manifests are what we check), but almost surely a misconfiguration.
            log.error("tracker signs with key %s, but we pin %s: its manifests will be refused",
                      fingerprint(theirs) if isinstance(theirs, str) and is_hex(theirs, 64, 64) else "?",
                      fingerprint(self.trusted_public))

    def _join_msg(self) -> Join:
        if not self.cfg.relay or self.port is None or self.leaf_only:
            return Join(None, False, self.cfg.name)
        if self.cfg.advertise:
            return Join(self.cfg.advertise, True, self.cfg.name)
        if not is_wildcard(self.host):  # bound to one address: the only one it answers on
            return Join(relay_url(self.host, self.port), True, self.cfg.name)
        return Join(None, True, self.cfg.name, port=self.port)  # the tracker pairs it with our source address

    async def connect(self) -> None:
        """Check the tracker's key and join, retrying with backoff for as long as it takes."""
        backoff, checked = Backoff(), False
        while not self.evicted:
            try:
                if not checked:
                    await self._check_tracker_key()
                    checked = True
                if await self._join_once():
                    return
            except (*NET_ERRORS, msgspec.DecodeError) as e:
                wait = backoff()
                log.warning("tracker %s unreachable (%s); retrying in %.1fs", self.tracker_url,
                            f"{type(e).__name__} {e}".strip(), wait)
                await asyncio.sleep(wait)
                continue
            await asyncio.sleep(backoff())

    async def _join_once(self) -> bool:
        """One signed join; True once joined (or evicted). Refusals of our address fall back to a leaf."""
        msg = sign_join(self._join_msg(), self.keypair)
        status, body = await self._post("/join", msg)
        text = body[:300].decode(errors="replace")
        if status == 200:
            self._joined(decode(body, Joined))
            return True
        if status == 403 and "banned" in text:
            self._set_evicted(text)
            return True
        if status in (400, 403, 409) and msg.relay:
            log.error("the tracker refused our relay address: %s %s; downloading only (pass --advertise "
                      "http://HOST:PORT with an address others reach this machine at)", status, text)
            self.leaf_only = True
            return False
        log.warning("tracker refused join: %s %s", status, text)
        return False

    def _joined(self, j: Joined) -> None:
        if not 1 <= j.trees <= 64 or not 0.05 <= j.heartbeat_interval <= 600:
            raise msgspec.DecodeError(f"tracker sent an implausible config: {j}")
        self.peer_id, self.token, self.trees, self.heartbeat_s = j.peer_id, j.token, j.trees, j.heartbeat_interval
        self.sources, self.sources_tag = [[] for _ in range(self.trees)], ""
        self.low = self.on_trial = frozenset()
        self.observed_host, self.url, self.reachable = j.observed_host, j.url, j.reachable
        log.info("joined %s as %s, key %s, seen from %s, %d trees", self.tracker_url, self.peer_id,
                 self.keypair.fingerprint, j.observed_host or "?", self.trees)
        self._log_reach(j.reach_error)

    def _log_reach(self, detail: str = "") -> None:
        if self.url and self.reachable:
            log.info("relay reachable at %s", self.url)
        elif self.cfg.relay and self.port is not None:
            port = parse_relay_url(self.cfg.advertise)[1] if self.cfg.advertise else self.port
            hint = f"open port {port} or pass --advertise"
            if self.host and is_loopback(self.host) and not is_loopback(URL(self.tracker_url).host or ""):
                hint = f"it listens on {self.host} only: pass --relay-host 0.0.0.0"
            log.warning("relay not reachable from the tracker: downloading only; %s%s", hint,
                        f" ({detail})" if detail else "")

    def _set_evicted(self, why: str) -> None:
        log.error("evicted by the tracker: %s", why)
        self.evicted = why
        self.on_evicted(why)

    # -- heartbeats -----------------------------------------------------------------------------------
    async def heartbeat_once(self) -> None:
        async with self._beat:
            await self._heartbeat()

    async def _heartbeat(self) -> None:
        if not self.peer_id:
            return
        h = self.holdings()
        msg = PeerHeartbeat(self.peer_id, self.token, h.complete, h.progress, h.served_bytes,
                            dict(list(h.received.items())[-64:]), h.recent, self.sources_tag)
        try:
            status, body = await self._post("/heartbeat", msg)
        except NET_ERRORS as e:
            log.warning("heartbeat failed (%s); keeping current parents", e)
            return
        if status == 404:
            log.warning("tracker forgot us; joining again")
            await self.connect()
            return
        if status == 410:
            self._set_evicted(body[:300].decode(errors="replace"))
            return
        if status != 200:
            log.warning("heartbeat refused: %s %s", status, body[:200])
            return
        try:
            a = decode(body, TreeSources)
            unchanged = not a.sources and a.tag and a.tag == self.sources_tag
            if unchanged:
                a.sources = self.sources  # unchanged since the last heartbeat
            if len(a.sources) != self.trees or not all(
                    len(c) <= 64 and all(u.startswith("http://") and len(u) < 256 for u in c) for c in a.sources):
                raise ValueError("malformed sources")
            if len(a.low) > 256 or not all(0 < len(h) <= 64 for h in a.low) or len(a.trial) > 64:
                raise ValueError("malformed low-priority addresses or relays on trial")
        except (msgspec.DecodeError, ValueError) as e:
            log.warning("bad assignment from tracker: %s", e)
            return
        self.sources, self.sources_tag = a.sources, a.tag[:32]
        if not unchanged:
            self.low, self.on_trial = frozenset(a.low), frozenset(u for chain in a.sources for u in chain if u in a.trial)
        if a.reachable is not None and a.reachable != self.reachable and self.url:
            self.reachable = a.reachable
            self._log_reach("the tracker checked again")
        if a.latest is not None:
            self.note_latest(a.latest)
        if self.known_latest is not None:
            self.on_latest(self.known_latest)  # a download that failed (origin down) starts again

    async def heartbeat_loop(self) -> None:
        while not self.evicted:
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self.hb_now.wait()
            except TimeoutError:
                pass
            self.hb_now.clear()
            self._hb_started += 1
            try:
                await self.heartbeat_once()
            except (FetchError, msgspec.DecodeError) as e:
                log.warning("%s", e)
            finally:
                self._hb_finished = self._hb_started
                async with self._hb_done:
                    self._hb_done.notify_all()

    async def fresh_sources(self, timeout: float) -> None:
        """Wait (at most `timeout`) for a heartbeat begun after now: the tracker's answer to what we just
        reported, our new parents."""
        want = self._hb_started + 1
        self.hb_now.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._hb_done:
                await self._hb_done.wait_for(lambda: self._hb_finished >= want)

    # -- versions -------------------------------------------------------------------------------------
    async def query_latest(self, after: int | None = None, wait: float = 0) -> int | None:
        assert self.session
        q = f"?after={after}&wait={wait}" if after is not None else ""
        async with self.session.get(f"{self.tracker_url}/latest{q}",
                                    timeout=aiohttp.ClientTimeout(total=wait + 10)) as r:
            if r.status != 200:
                raise FetchError(f"tracker /latest answered {r.status}")
            lat = decode(await read_capped(r.content, 1 << 16), Latest)
        return lat.latest

    async def watch_loop(self) -> None:
        """Long-poll the tracker so a new version starts flowing at once, not at the next heartbeat."""
        backoff = Backoff()
        while not self.evicted:
            try:
                latest = await self.query_latest(self.known_latest if self.known_latest is not None else -1, 20)
                backoff.reset()
                if latest is not None:
                    self.note_latest(latest)
            except (*NET_ERRORS, FetchError, msgspec.DecodeError) as e:
                wait = backoff()
                log.warning("watching the tracker failed (%s); retrying in %.1fs", e, wait)
                await asyncio.sleep(wait)

    def note_latest(self, latest: int) -> None:
        if latest < 0 or (self.known_latest is not None and latest <= self.known_latest):
            return
        self.known_latest = latest
        self.on_latest(latest)

    # -- reports and leaving --------------------------------------------------------------------------
    async def report(self, r: RaceReport, version: int, piece: int) -> None:
        log.warning("reporting %s as %s (v%d piece %d): %s", r.src, r.reason, version, piece, r.detail)
        if not self.peer_id:
            return
        try:
            status, body = await self._post("/report", Report(self.peer_id, self.token, r.src, r.reason, version,  # type: ignore[arg-type]
                                                              piece, r.detail[:200]))
            log.info("tracker on %s: %s %s", r.src, status, body[:100].decode(errors="replace"))
        except NET_ERRORS as e:
            log.warning("could not report %s: %s", r.src, e)
        self.hb_now.set()  # fetch the new assignment now

    async def leave(self) -> None:
        if self.session and self.peer_id and not self.evicted:
            with contextlib.suppress(*NET_ERRORS):
                await self._post("/leave", Leave(self.peer_id, self.token), timeout=2)

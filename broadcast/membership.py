"""A peer's side of the tracker: a signed join (retried with backoff, never fatal), heartbeats, the long
poll for new versions, reports, and the answer to the tracker's connect-back.

Mixed into `Peer` (peer.py), whose state it shares: it only talks to the tracker; downloading and serving
are peer.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from swarm_common.http import read_capped
from swarm_common.keys import fingerprint

from .addresses import is_loopback, is_wildcard, parse_relay_url, relay_url
from .identity import is_hex, reach_answer, sign_join
from .messages import ORIGIN, Join, Joined, Latest, PeerHeartbeat, Report, TreeSources, decode

if TYPE_CHECKING:
    from .peer import Peer

log = logging.getLogger("broadcast.peer")
BACKOFF_MAX_S = 30.0
NET_ERRORS = (TimeoutError, aiohttp.ClientError, OSError)


class FetchError(RuntimeError):
    """A version could not be fetched and verified; nothing partial is ever returned."""


class Evicted(FetchError):
    """The tracker removed this peer (e.g. it was caught serving corrupt data)."""


class Backoff:
    def __init__(self, first: float = 0.5, cap: float = BACKOFF_MAX_S):
        self.first, self.cap, self.next = first, cap, first

    def __call__(self) -> float:
        wait, self.next = self.next, min(self.cap, self.next * 2)
        return wait

    def reset(self) -> None:
        self.next = self.first


class Membership:
    async def _post(self: Peer, path: str, msg: msgspec.Struct, timeout: float = 10) -> tuple[int, bytes]:
        assert self._session
        async with self._session.post(
            self.tracker_url + path,
            data=msgspec.json.encode(msg),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            return r.status, await read_capped(r.content, 1 << 20)

    async def _check_tracker_key(self: Peer) -> None:
        assert self._session
        async with self._session.get(self.tracker_url + "/info", timeout=aiohttp.ClientTimeout(total=5)) as r:
            info = msgspec.json.decode(await read_capped(r.content, 4096))
        theirs = info.get("public_key") if isinstance(info, dict) else None
        if theirs != self.trusted_public.hex():
            # Not fatal on its own (manifests are what we check), but almost surely a misconfiguration.
            log.error("tracker signs with key %s, but we pin %s: its manifests will be refused",
                      fingerprint(theirs) if isinstance(theirs, str) and is_hex(theirs, 64, 64) else "?",
                      fingerprint(self.trusted_public))

    def _join_msg(self: Peer) -> Join:
        if not self.relay or self.port is None or self._leaf_only:
            return Join(None, False, self.name)
        if self.advertise:
            return Join(self.advertise, True, self.name)
        if not is_wildcard(self.host):
            # Bound to one address: that is the only one it answers on.
            return Join(relay_url(self.host, self.port), True, self.name)  # type: ignore[arg-type]
        return Join(None, True, self.name, port=self.port)  # the tracker pairs the port with our source address

    async def _connect(self: Peer) -> None:
        """Check the tracker's key and join, retrying with backoff for as long as it takes."""
        backoff = Backoff()
        checked = False
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

    async def _join_once(self: Peer) -> bool:
        """One signed join; True once joined (or evicted). Refusals of our address fall back to a leaf."""
        msg = sign_join(self._join_msg(), self.keypair)
        status, body = await self._post("/join", msg)
        text = body[:300].decode(errors="replace")
        if status == 200:
            self._joined(decode(body, Joined))
            return True
        if status == 403 and "banned" in text:
            await self._set_evicted(text)
            return True
        if status in (400, 403, 409) and msg.relay:
            log.error("the tracker refused our relay address: %s %s; downloading only (pass --advertise "
                      "http://HOST:PORT with an address others reach this machine at)", status, text)
            self._leaf_only = True
            return False
        log.warning("tracker refused join: %s %s", status, text)
        return False

    def _joined(self: Peer, j: Joined) -> None:
        if not 1 <= j.trees <= 64 or not 0.05 <= j.heartbeat_interval <= 600:
            raise msgspec.DecodeError(f"tracker sent an implausible config: {j}")
        self.peer_id, self._token, self.trees, self.heartbeat_interval = (
            j.peer_id, j.token, j.trees, j.heartbeat_interval)
        self.sources = [[self.tracker_url] for _ in range(self.trees)]
        self._sources_tag = ""
        self.observed_host, self.url, self.reachable = j.observed_host, j.url, j.reachable
        log.info("joined %s as %s, key %s, seen from %s, %d trees", self.tracker_url, self.peer_id,
                 self.keypair.fingerprint, j.observed_host or "?", self.trees)
        self._log_reach(j.reach_error)

    def _log_reach(self: Peer, detail: str = "") -> None:
        if self.url and self.reachable:
            log.info("relay reachable at %s", self.url)
        elif self.relay and self.port is not None:
            port = parse_relay_url(self.advertise)[1] if self.advertise else self.port
            hint = f"open port {port} or pass --advertise"
            if self.host and is_loopback(self.host) and not is_loopback(URL(self.tracker_url).host or ""):
                hint = f"it listens on {self.host} only: pass --relay-host 0.0.0.0"
            log.warning("relay not reachable from the tracker: downloading only; %s%s", hint,
                        f" ({detail})" if detail else "")

    async def _heartbeat_once(self: Peer) -> None:
        if not self.peer_id:
            return
        progress = {v: st.n_have for v, st in self.states.items() if not st.complete}
        msg = PeerHeartbeat(self.peer_id, self._token, self.complete_versions(), progress, self.served_bytes,
                            self._named(dict(list(self.received.items())[-64:])),
                            self._named(self._received.take()), self._sources_tag)
        try:
            status, body = await self._post("/heartbeat", msg)
        except NET_ERRORS as e:
            log.warning("heartbeat failed (%s); keeping current parents", e)
            return
        if status == 404:
            log.warning("tracker forgot us; joining again")
            await self._connect()
            return
        if status == 410:
            await self._set_evicted(body[:300].decode(errors="replace"))
            return
        if status != 200:
            log.warning("heartbeat refused: %s %s", status, body[:200])
            return
        try:
            a = decode(body, TreeSources)
            if not a.sources and a.tag and a.tag == self._sources_tag:
                a.sources = self.sources  # unchanged since the last heartbeat
            if len(a.sources) != self.trees or not all(
                len(c) <= 64 and all(u.startswith("http://") and len(u) < 256 for u in c) for c in a.sources
            ):
                raise ValueError("malformed sources")
        except (msgspec.DecodeError, ValueError) as e:
            log.warning("bad assignment from tracker: %s", e)
            return
        self.sources, self._sources_tag = a.sources, a.tag[:32]
        if a.reachable is not None and a.reachable != self.reachable and self.url:
            self.reachable = a.reachable
            self._log_reach("the tracker checked again")
        if a.latest is not None:
            await self._note_latest(a.latest)
        if self.follow and self.known_latest is not None and self.known_latest not in self.complete_versions():
            self._ensure_download(self.known_latest)  # a download that failed (origin down) starts again

    def _named(self: Peer, by_url: dict) -> dict:
        """Per source as the tracker names them: the origin as ORIGIN, not at the URL we reach it at."""
        return {ORIGIN if url == self.tracker_url else url: v for url, v in by_url.items()}

    async def _set_evicted(self: Peer, why: str) -> None:
        log.error("evicted by the tracker: %s", why)
        self.evicted = why
        for t in self._downloads.values():
            t.cancel()
        async with self._changed:
            self._changed.notify_all()

    async def _heartbeat_loop(self: Peer) -> None:
        while not self.evicted:
            try:
                async with asyncio.timeout(self.heartbeat_interval):
                    await self._hb_now.wait()
            except TimeoutError:
                pass
            self._hb_now.clear()
            self._hb_started += 1
            try:
                await self._heartbeat_once()
            except (FetchError, msgspec.DecodeError) as e:
                log.warning("%s", e)
            finally:
                self._hb_finished = self._hb_started
                async with self._hb_done:
                    self._hb_done.notify_all()

    async def _fresh_sources(self: Peer, timeout: float) -> None:
        """Wait (at most `timeout`) for a heartbeat begun after now: the tracker's answer to what we just
        reported, our new parents."""
        want = self._hb_started + 1
        self._hb_now.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._hb_done:
                await self._hb_done.wait_for(lambda: self._hb_finished >= want)

    async def _query_latest(self: Peer, after: int | None = None, wait: float = 0) -> int | None:
        assert self._session
        q = f"?after={after}&wait={wait}" if after is not None else ""
        async with self._session.get(
            f"{self.tracker_url}/latest{q}", timeout=aiohttp.ClientTimeout(total=wait + 10)
        ) as r:
            if r.status != 200:
                raise FetchError(f"tracker /latest answered {r.status}")
            lat = decode(await read_capped(r.content, 1 << 16), Latest)
        return lat.latest

    async def _watch_loop(self: Peer) -> None:
        """Long-poll the tracker so a new version starts flowing at once, not at the next heartbeat."""
        backoff = Backoff()
        while not self.evicted:
            try:
                latest = await self._query_latest(self.known_latest if self.known_latest is not None else -1, 20)
                backoff.reset()
                if latest is not None:
                    await self._note_latest(latest)
            except (*NET_ERRORS, FetchError, msgspec.DecodeError) as e:
                wait = backoff()
                log.warning("watching the tracker failed (%s); retrying in %.1fs", e, wait)
                await asyncio.sleep(wait)

    async def _note_latest(self: Peer, latest: int) -> None:
        if latest < 0 or (self.known_latest is not None and latest <= self.known_latest):
            return
        self.known_latest = latest
        async with self._changed:
            self._changed.notify_all()
        if self.follow:
            self._ensure_download(latest)

    async def _report(self: Peer, url: str, reason: str, version: int, piece: int, detail: str) -> None:
        log.warning("reporting %s as %s (v%d piece %d): %s", url, reason, version, piece, detail)
        if not self.peer_id:
            return
        try:
            status, body = await self._post(
                "/report", Report(self.peer_id, self._token, url, reason, version, piece, detail[:200]))  # type: ignore[arg-type]
            log.info("tracker on %s: %s %s", url, status, body[:100].decode(errors="replace"))
        except NET_ERRORS as e:
            log.warning("could not report %s: %s", url, e)
        self._hb_now.set()  # fetch the new assignment now

    async def _reach(self: Peer, request: web.Request) -> web.Response:
        """The tracker's connect-back: sign its nonce, so it knows this address answers for our key."""
        nonce = request.query.get("nonce", "")
        if not is_hex(nonce, 16, 64):
            raise web.HTTPBadRequest(text="nonce must be 16-64 hex digits")
        return web.Response(body=msgspec.json.encode(reach_answer(nonce, self.keypair)),
                            content_type="application/json")

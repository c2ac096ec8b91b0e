"""The origin's own probes of relays, and its judgement of reports: nothing is decided by count.

Reporters are untrusted like everyone else. A corrupt report is settled by fetching the whole piece from the
accused and hashing it; a dead or stall report by connecting back to the accused (it must sign our nonce)
and timing a piece it says it holds. What the origin confirms acts; what it cannot confirm costs the
reporter standing, never the accused its place. Reports of peers with standing (two distinct keys) may
demote a relay the origin's probes cannot catch; reports of fresh keys never move anyone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import msgspec

from swarm_common.http import read_capped

from .identity import check_reach
from .messages import ReachAnswer, Report, decode

if TYPE_CHECKING:
    from .store import VersionState
    from .tracker import PeerRec, Tracker

log = logging.getLogger("broadcast.judge")
PROBE_CACHE_S = 2.0  # one probe of a peer answers every report about it for this long
PROVE_RETRY_S = 10.0
MAX_PROBES = 8  # probes in flight at once, all kinds together
RETRY_S = 1.0  # a probe that fails is tried once more this much later before it counts


class Prober:
    """Connects back to relays: signed-nonce reachability checks and whole-piece fetches."""

    def __init__(self, session: aiohttp.ClientSession, connect_timeout: float = 2.0, ttfb: float = 2.0):
        self.session = session
        self.connect_timeout, self.ttfb = connect_timeout, ttfb
        self._sem = asyncio.Semaphore(MAX_PROBES)

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout, sock_read=self.ttfb)

    async def reach(self, url: str, key: str | None) -> tuple[str, str | None, str]:
        """('ok' | 'mismatch' | 'unreachable' | 'not_relay', the key that answered, detail). With key None
        any relay's signed answer counts (the doctor's test)."""
        nonce = secrets.token_hex(16)
        async with self._sem:
            try:
                async with self.session.get(f"{url}/reach", params={"nonce": nonce},
                                            timeout=self._timeout(self.connect_timeout + self.ttfb)) as r:
                    body = await read_capped(r.content, 4096)
                    status = r.status
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                return "unreachable", None, f"connect-back to {url} failed: {type(e).__name__} {e}".strip()
        if status != 200:
            return "not_relay", None, f"{url} answered HTTP {status}, not a relay's /reach"
        try:
            ans = decode(body, ReachAnswer)
        except (msgspec.DecodeError, ValueError) as e:
            return "not_relay", None, f"{url} answered /reach with something else: {e}"
        why = check_reach(ans, nonce, ans.key if key is None else key)
        if why:
            return "mismatch", ans.key if len(ans.key) == 64 else None, f"connect-back to {url}: {why}"
        return "ok", ans.key, f"{url} answers for key {ans.key[:16]}..."

    async def answers(self, url: str, version: int, index: int) -> str:
        """'answers' when a piece request gets any answer (an honest relay answers at once, even for a piece
        still on its way to it), 'stall' when none comes within the deadline, 'dead' when it can't connect."""
        async with self._sem:
            try:
                async with self.session.get(f"{url}/v/{version}/piece/{index}",
                                            timeout=self._timeout(self.connect_timeout + self.ttfb)):
                    return "answers"
            except TimeoutError:
                return "stall"
            except (aiohttp.ClientError, OSError):
                return "dead"

    async def piece(self, url: str, st: VersionState, index: int, total: float = 30.0) -> str:
        """'ok' or 'corrupt' (the whole piece, hashed), 'stall' (no answer within the deadline), 'slow' (an
        answer, but not the whole piece in time: inconclusive), 'dead', or 'unknown' (not held there)."""
        ref = st.pieces[index]
        answered = False
        async with self._sem:
            try:
                timeout = aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout, sock_read=10.0)
                async with asyncio.timeout(self.connect_timeout + self.ttfb):
                    r = await self.session.get(f"{url}/v/{st.version}/piece/{index}", timeout=timeout)
                    answered = True
                async with r:
                    if r.status != 200:
                        return "unknown"
                    buf = bytearray()
                    async for chunk in r.content.iter_chunked(1 << 20):  # every byte of it, not one read
                        buf += chunk
                        if len(buf) > ref.size:
                            break
            except TimeoutError:
                return "slow" if answered else "stall"
            except (aiohttp.ClientError, OSError):
                return "dead"
        return "ok" if await asyncio.to_thread(ref.matches, bytes(buf)) else "corrupt"


class Judge:
    def __init__(self, tracker: Tracker, prober: Prober, versions: Callable[[], dict[int, VersionState]],
                 on_ban: Callable[[str, str], None] | None = None):
        self.tracker, self.prober, self.versions = tracker, prober, versions
        self.on_ban = on_ban
        self._cache: dict[tuple[str, str], tuple[float, str, str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._proving: dict[str, float] = {}
        self.tasks: set[asyncio.Task] = set()

    def ban(self, rec: PeerRec, reason: str, reporter: str) -> None:
        self.tracker.ban(rec.peer_id, reason, reporter)
        self.tracker.count("confirmed_corrupt")
        if self.on_ban and rec.key and not rec.key.startswith("anon-"):
            try:
                self.on_ban(rec.key, reason)
            except Exception:  # noqa: BLE001 - the trainer's hook must not break the tracker
                log.exception("on_ban hook failed")

    async def _once(self, rec: PeerRec, kind: str, probe, what: str = "") -> str:
        """Probe a peer at most once per PROBE_CACHE_S for each kind of probe, whatever the number of reports:
        the verdict is reused for the same target (`what`), and another target waits its turn (reports
        are rate-limited, so the queue is short; a verdict dropped as 'recent' let a corrupting relay that
        had just served the origin an intact piece go on)."""
        lock = self._locks.setdefault(rec.peer_id, asyncio.Lock())
        async with lock:
            hit = self._cache.get((rec.peer_id, kind))
            if hit and (age := time.monotonic() - hit[0]) < PROBE_CACHE_S:
                if hit[1] == what:
                    return hit[2]
                await asyncio.sleep(PROBE_CACHE_S - age)
            verdict = await probe()
            self._cache[(rec.peer_id, kind)] = (time.monotonic(), what, verdict)
            if len(self._cache) > 4096:
                self._cache = {k: v for k, v in self._cache.items() if time.monotonic() - v[0] < PROBE_CACHE_S}
                self._locks = {k: v for k, v in self._locks.items() if v.locked() or k in self.tracker.peers}
        return verdict

    async def recheck_reach(self, rec: PeerRec) -> bool:
        """Connect back to the relay (it must sign our nonce); not reachable makes it a leaf."""
        if rec.url is None:
            return False

        async def probe() -> str:
            for attempt in range(2):  # a loaded machine may miss one deadline: failing twice counts
                status, _, detail = await self.prober.reach(rec.url, rec.key)
                if status == "ok" or attempt:
                    return status if status == "ok" else f"{status}: {detail}"
                await asyncio.sleep(RETRY_S)
            return "unreachable"

        verdict = await self._once(rec, "reach", probe)
        if rec.peer_id in self.tracker.peers:
            self.tracker.set_reachable(rec, verdict == "ok", "" if verdict == "ok" else verdict)
        return verdict == "ok"

    async def probe_piece(self, rec: PeerRec, version: int, index: int) -> str:
        st = self.versions().get(version)
        if rec.url is None or st is None or not 0 <= index < len(st.pieces):
            return "unknown"
        url = rec.url
        return await self._once(rec, "piece", lambda: self.prober.piece(url, st, index), f"{version}/{index}")

    async def judge(self, reporter: PeerRec, accused: PeerRec, msg: Report) -> str:
        t = self.tracker
        who = f"{reporter.peer_id} ({reporter.key[:12]})"
        if msg.reason == "corrupt":
            verdict = await self.probe_piece(accused, msg.version, msg.piece)
            if verdict == "corrupt":
                self.ban(accused, f"served corrupt piece {msg.piece} of v{msg.version} (confirmed by origin)",
                         reporter.peer_id)
                return "banned"
            if verdict in ("dead", "stall") and not await self.recheck_reach(accused):
                return "leaf: not reachable"
            if verdict in ("slow", "dead", "stall"):
                t.event(f"corrupt report on {accused.peer_id} by {who}: inconclusive ({verdict})")
                return "inconclusive"
            t.penalize(reporter.key, f"corrupt report on {accused.peer_id}: origin's probe says {verdict}")
            return "not confirmed"
        if not await self.recheck_reach(accused):
            return "leaf: not reachable"
        if msg.version in self.versions() and 0 <= msg.piece < len(self.versions()[msg.version].pieces):
            url = accused.url or ""
            async def answers() -> str:
                first = await self.prober.answers(url, msg.version, msg.piece)
                if first != "stall":
                    return first
                await asyncio.sleep(RETRY_S)
                return await self.prober.answers(url, msg.version, msg.piece)

            verdict = await self._once(accused, "answers", answers, f"{msg.version}/{msg.piece}")
            if verdict == "stall":
                t.demote(accused.peer_id, f"left the origin's piece request unanswered ({who} reported)")
                t.count("confirmed_stall")
                return "demoted"
        if t.has_standing(reporter):
            accused.reporters.add(reporter.key)
            accused.strikes += 1
            if msg.reason == "stall" and len(accused.reporters) >= 2:
                t.demote(accused.peer_id, f"stalls reported by {len(accused.reporters)} peers with standing")
                return "demoted"
            t.event(f"{msg.reason} report on {accused.peer_id} by {who} (standing): noted")
            return "noted"
        t.penalize(reporter.key, f"{msg.reason} report on {accused.peer_id}: it answers the origin's probes")
        return "not confirmed"

    def maybe_prove(self, rec: PeerRec) -> None:
        """A relay that reports a complete version we serve: fetch one random piece of it back. Served in
        time and intact, the relay has shown it uploads (it rises above fresh peers); corrupt bans it."""
        t = self.tracker
        if (rec.key in t.proven or not rec.interior_capable or not rec.complete
                or time.monotonic() - self._proving.get(rec.key, -1e9) < PROVE_RETRY_S):
            return
        vs = self.versions()
        held = [v for v in rec.complete if v in vs]
        if not held:
            return
        self._proving[rec.key] = time.monotonic()
        if len(self._proving) > 4096:
            self._proving = {k: v for k, v in self._proving.items() if time.monotonic() - v < PROVE_RETRY_S}
        v = held[-1]
        index = random.randrange(len(vs[v].pieces))

        async def run() -> None:
            verdict = await self.probe_piece(rec, v, index)
            if rec.peer_id not in t.peers:
                return
            if verdict == "ok":
                t.prove(rec, f"served piece {index} of v{v} to the origin intact")
            elif verdict == "corrupt":
                self.ban(rec, f"served corrupt piece {index} of v{v} to the origin's probe", "origin")
            elif verdict == "stall" and await self.recheck_reach(rec):
                t.demote(rec.peer_id, f"stalled the origin's request for piece {index} of v{v}, which it holds")
                t.count("confirmed_stall")
            elif verdict == "dead":
                await self.recheck_reach(rec)

        task = asyncio.create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

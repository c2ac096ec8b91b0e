"""The origin's probes of relays over HTTP, and the driver of its verdicts (verdicts.py decides)."""

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
from .piece_pass import headers, piece_name, posing_as
from .verdicts import (
    PROBE_CACHE_S,
    REFUSED,
    BanHook,
    Flow,
    Pause,
    Probe,
    judge_report,
    prove,
    prove_target,
    recheck_reach,
)

if TYPE_CHECKING:
    from .store import VersionState
    from .tracker import PeerRec, Tracker

log = logging.getLogger("broadcast.judge")
MAX_PROBES = 8  # probes in flight at once, all kinds together


class Prober:
    """Connects back to relays: signed-nonce reachability checks and whole-piece fetches."""

    def __init__(self, session: aiohttp.ClientSession, pieces: aiohttp.ClientSession | None = None,
                 connect_timeout: float = 2.0, ttfb: float = 2.0):
        self.session = session
        self.pieces = pieces or session  # piece requests: sent as a peer's are (piece_pass.py)
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
                if isinstance(getattr(e, "os_error", e), ConnectionRefusedError):  # nothing listens there
                    return "unreachable", None, f"connect-back to {url} failed: {REFUSED}"
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

    async def answers(self, url: str, version: int, index: int, headers: dict[str, str] | None = None) -> str:
        """'answers' when a piece request gets any answer (an honest relay answers at once, even for a piece
        still on its way to it), 'stall' when none comes within the deadline, 'dead' when it can't connect."""
        async with self._sem:
            try:
                async with self.pieces.get(f"{url}/v/{version}/piece/{index}", headers=headers,
                                            timeout=self._timeout(self.connect_timeout + self.ttfb)):
                    return "answers"
            except TimeoutError:
                return "stall"
            except (aiohttp.ClientError, OSError):
                return "dead"

    async def piece(self, url: str, st: VersionState, index: int, total: float = 30.0,
                    headers: dict[str, str] | None = None) -> str:
        """'ok' or 'corrupt' (the whole piece, hashed), 'stall' (no answer within the deadline), 'slow' (an
        answer, but not the whole piece in time: inconclusive), 'dead', or 'unknown' (not held there)."""
        ref = st.pieces[index]
        answered = False
        async with self._sem:
            try:
                timeout = aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout, sock_read=10.0)
                async with asyncio.timeout(self.connect_timeout + self.ttfb):
                    r = await self.pieces.get(f"{url}/v/{st.version}/piece/{index}", headers=headers, timeout=timeout)
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
    """Runs verdicts.py's flows: their probes over HTTP (one probe of a peer answers every report about it
    for PROBE_CACHE_S), their pauses on the event loop, their bans through the trainer's hook."""

    def __init__(self, tracker: Tracker, prober: Prober, versions: Callable[[], dict[int, VersionState]],
                 on_ban: Callable[[str, str], None] | None = None):
        self.tracker, self.prober, self.versions = tracker, prober, versions
        self.on_ban = on_ban
        self._cache: dict[tuple[str, str], tuple[float, str, str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._proving: dict[str, float] = {}
        self._rng = random.Random()
        self.tasks: set[asyncio.Task] = set()

    def _pieces(self, version: int) -> int | None:
        st = self.versions().get(version)
        return None if st is None else len(st.pieces)

    async def run(self, flow: Flow) -> str:
        """Drive one verdict to its end; its result."""
        result: str | None = None
        try:
            while True:
                step = flow.send(result)
                result = None
                if isinstance(step, Probe):
                    result = await self._probe(step)
                elif isinstance(step, Pause):
                    await asyncio.sleep(step.seconds)
                else:
                    self._hook(step)
        except StopIteration as done:
            return done.value

    def _hook(self, ban: BanHook) -> None:
        if self.on_ban:
            try:
                self.on_ban(ban.key, ban.reason)
            except Exception:  # noqa: BLE001 - the trainer's hook must not break the tracker
                log.exception("on_ban hook failed")

    async def _probe(self, p: Probe) -> str:
        rec, url = p.rec, p.rec.url or ""
        if p.kind == "reach":
            async def reach() -> str:
                status, _, detail = await self.prober.reach(url, rec.key)
                return "ok" if status == "ok" else f"{status}: {detail}"
            return await self._once(rec, "reach", reach)
        # As one of its receivers would ask (piece_pass.py): by its headers, not the origin's check.
        who = posing_as(self.tracker.peers, rec)
        hdrs = headers(who.peer_id if who else None, who.token if who else "", piece_name(p.version, p.index))
        if p.kind == "answers":
            return await self._once(rec, "answers", lambda: self.prober.answers(url, p.version, p.index, hdrs),
                                    f"{p.version}/{p.index}")
        st = self.versions().get(p.version)
        if st is None or not 0 <= p.index < len(st.pieces):
            return "unknown"
        return await self._once(rec, "piece", lambda: self.prober.piece(url, st, p.index, headers=hdrs),
                                f"{p.version}/{p.index}")

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

    async def judge(self, reporter: PeerRec, accused: PeerRec, msg: Report) -> str:
        return await self.run(judge_report(self.tracker, reporter, accused, msg, self._pieces))

    async def recheck_reach(self, rec: PeerRec) -> bool:
        return await self.run(recheck_reach(self.tracker, rec)) == "ok"

    def maybe_prove(self, rec: PeerRec) -> None:
        """A relay that reports a complete version we serve: fetch one random piece of it back
        (verdicts.prove)."""
        pieces = {v: len(st.pieces) for v, st in self.versions().items()}
        target = prove_target(self.tracker, rec, pieces, self._proving, self._rng)
        if target is not None:
            self.spawn(self.run(prove(self.tracker, rec, *target)))

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

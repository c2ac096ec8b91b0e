"""A peer's pieces over HTTP: drives piece_race.PieceRace with real requests and the real clock.

Each try is one GET of /v/N/piece/I (with the peer's id in X-Peer, so the source can take its requests in
turns, and its pass for that piece, which the origin asks of members: piece_pass.py); what happens to it (answer, bytes, hash, failure) is fed to the race and the SourceBook, which
decide; this file only does the I/O. The simulator (bench/simlib) drives the same race on simulated time.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import logging
import socket
import termios
import time

import aiohttp

from .errors import Evicted, FetchError
from .manifest import PieceRef
from .messages import ORIGIN
from .piece_pass import headers, piece_name
from .piece_race import PieceRace, retry_plan
from .receive_meter import sending_started
from .sourcing import SourceBook, Try, other_parents
from .store import VersionState
from .tracker_client import TrackerClient

log = logging.getLogger("broadcast.peer")
RECV_CHUNK = 1 << 20  # a piece arrives in a few reads, not one per 64 KiB
HASH_INLINE = 256 << 10  # smaller pieces are hashed on the loop: a thread's hand-off cost more than the hash
# Wake for a piece's bytes in batches (SO_RCVLOWAT), not for every few packets: at 20 Mbit/s a 256 KiB
# piece woke the receiver ~117 times (2.2 KiB each), most of a relay's CPU (bench/relay_cpu.py). A batch is
# what this answer delivers in LOWAT_S at the rate it has come so far, at most RECV_LOWAT: a slow source's
# bytes are still seen as they come (its liveness and its rate are judged by them: sourcing.py).
RECV_LOWAT = 64 << 10
LOWAT_S = 0.05


def _unread(sock: socket.socket | None) -> int:
    """Bytes that reached this socket and wait to be read (FIONREAD); 0 when that cannot be told."""
    if sock is None:
        return 0
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except (OSError, ValueError):
        return 0
    return max(0, buf[0])


def _wake_at(sock: socket.socket | None, nbytes: int) -> None:
    """The kernel wakes this socket's reader once `nbytes` are waiting (or the peer closed, or it errs)."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, max(1, nbytes))


async def _verified(ref: PieceRef, data: bytes) -> bool:
    """Hashed in a thread when large (hashlib lets go of the GIL: the loop goes on receiving meanwhile); a
    32 KiB piece's hash takes ~0.06 ms, its hand-off to a thread ~0.5 ms of the loop's time."""
    return ref.matches(data) if len(data) <= HASH_INLINE else await asyncio.to_thread(ref.matches, data)


class PieceFetcher:
    def __init__(self, book: SourceBook, tracker: TrackerClient):
        self.book, self.tracker = book, tracker
        self._bg: set[asyncio.Task] = set()  # reports sent while the race goes on
        self._bodies: dict[Try, tuple[aiohttp.ClientResponse, socket.socket | None]] = {}  # answers streaming

    def pending(self) -> list[asyncio.Task]:
        return list(self._bg)

    def url_of(self, src: str) -> str:
        return self.tracker.tracker_url if src == ORIGIN else src

    async def fetch_piece(self, st: VersionState, index: int, tree: int) -> None:
        failures = 0
        while True:
            if self.tracker.evicted:
                raise Evicted(self.tracker.evicted)
            self.book.on_trial = self.tracker.on_trial
            relays, now = self.tracker.relays(tree), time.monotonic()
            chain = self.book.chain(relays, now)
            others = other_parents(self.tracker.sources, tree)
            outcome = await self.race(st, index, chain, self.book.helpers(relays, chain, now, others), relays)
            if outcome == "ok":
                return
            failures += outcome != "gone"
            plan = retry_plan(outcome, failures, self.book)
            if plan.give_up:
                raise FetchError(f"v{st.version} piece {index}: {plan.give_up}")
            if plan.fresh_within:  # reported, so the tracker has given us new parents: ask them, not ours
                await asyncio.gather(asyncio.sleep(plan.wait_s), self.tracker.fresh_sources(plan.fresh_within))
            else:
                await asyncio.sleep(plan.wait_s)

    async def race(self, st: VersionState, index: int, chain: list[str], helpers: list[str] = (),
                   relays: list[str] | None = None) -> str:
        """One race for piece `index` along `chain` (then `helpers`): 'ok', 'gone', 'dead' or 'failed'
        (piece_race.py)."""
        race = PieceRace(self.book, chain, time.monotonic(), st.pieces[index].size, helpers, relays)
        tasks: dict[Try, asyncio.Task] = {}

        def send(tries: list[Try]) -> None:
            for tr in tries:
                tasks[tr] = asyncio.create_task(self._try(race, tr, st, index))

        send([race.start(time.monotonic())])
        try:
            while not race.result:
                self._peek(race)
                new, at = race.look(time.monotonic())
                send(new)
                self._send_reports(race, st.version, index)
                wait = None if at is None else max(0.0, at - time.monotonic())
                done, _ = await asyncio.wait(tasks.values(), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                for tr in [tr for tr, t in tasks.items() if t in done]:
                    task = tasks.pop(tr)
                    if task.exception() is not None:
                        log.warning("v%d piece %d from %s: %r", st.version, index, tr.src, task.exception())
                    new, cancel = race.ended(tr, time.monotonic())
                    send(new)
                    for c in cancel:
                        tasks.pop(c).cancel()
                    if race.result:
                        break
            self._send_reports(race, st.version, index)
            return race.result
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)

    def _peek(self, race: PieceRace) -> None:
        """What has reached us of each answer and waits to be read (in the kernel, or in aiohttp's buffer)
        counts as delivered: the reader is woken in batches (RECV_LOWAT), and the race judges a source's
        pace by what it delivered, not by what we got round to reading."""
        now = time.monotonic()
        for tr in race.tries:
            body = self._bodies.get(tr)
            if body is not None:
                r, sock = body
                self.book.waiting(tr, _unread(sock) + max(0, r.content.total_bytes - tr.got), now)

    def _send_reports(self, race: PieceRace, version: int, index: int) -> None:
        for r in race.reports:
            task = asyncio.create_task(self.tracker.report(r, version, index))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)
        race.reports.clear()

    async def _try(self, race: PieceRace, tr: Try, st: VersionState, index: int) -> None:
        """One GET of one piece from one source; what happened goes to the race."""
        assert self.tracker.session
        ref = st.pieces[index]
        how, detail = "unreachable", ""
        try:
            async with self.tracker.session.get(f"{self.url_of(tr.src)}/v/{st.version}/piece/{index}",
                                                headers=headers(self.tracker.peer_id, self.tracker.token,
                                                                piece_name(st.version, index), tr.hold)) as r:
                self.book.answered(tr, time.monotonic())
                if r.status == 404:
                    how = "absent"
                elif r.status != 200:
                    how, detail = "http", f"HTTP {r.status}"
                elif r.content_length is not None and r.content_length != ref.size:
                    how, detail = "corrupt", f"length {r.content_length} != {ref.size}"
                else:
                    buf, sent_from = await self._body(tr, r, ref)
                    if len(buf) != ref.size:
                        how, detail = "corrupt", f"{len(buf)} bytes, expected {ref.size}"
                    elif not await _verified(ref, buf):
                        how, detail = "corrupt", "sha256 mismatch"
                    else:
                        self.book.piece_in(tr, ref.size, time.monotonic(), sent_from)
                        if not st.abandoned and not st.have[index]:
                            st.write_piece(index, buf)  # on the loop: abandon() closes these files there
                            st.mark(index)
                        return
        except TimeoutError:
            how = "timeout"
        except aiohttp.ClientPayloadError as e:
            how, detail = "cut", str(e)
        except (aiohttp.ClientError, OSError) as e:
            how, detail = "unreachable", f"{type(e).__name__}: {e}"
        report = race.concluded(tr, how, time.monotonic(), detail)
        if tr.src == ORIGIN and how != "absent":
            log.warning("origin failed for v%d piece %d (%s %s): retrying", st.version, index, how, detail)
        if report is not None:  # awaited: a dead source's piece waits for the tracker's answer (piece_race.py)
            await self.tracker.report(report, st.version, index)

    async def _body(self, tr: Try, r: aiohttp.ClientResponse, ref: PieceRef) -> tuple[bytes, float | None]:
        chunks: list[bytes] = []
        first_at = now = time.monotonic()
        sent_from = None
        transport = r.connection.transport if r.connection is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        self._bodies[tr] = (r, sock)
        try:
            async for chunk in r.content.iter_chunked(RECV_CHUNK):
                now = time.monotonic()
                if not chunks:
                    first_at = now
                self.book.body(tr, len(chunk), now)
                chunks.append(chunk)
                if tr.got > ref.size:
                    break
                # Never more than what is still to come from the kernel, or the piece's tail would wait for
                # bytes that never come (what aiohttp has read already is in total_bytes).
                rate = tr.got / (now - first_at) if now > first_at else 0.0
                _wake_at(sock, min(int(rate * LOWAT_S), RECV_LOWAT, ref.size - r.content.total_bytes))
        finally:
            self._bodies.pop(tr, None)
            _wake_at(sock, 1)  # the connection goes back to the pool: the next answer's headers wake us at once
            # Placement's evidence: how long it was sending, not holding (None: no way to tell).
            if chunks:
                sent_from = sending_started(tr.answered_at, first_at, now, len(chunks[0]), tr.got)
            if sent_from is not None:
                self.book.sending_span(tr, sent_from, now)
        return b"".join(chunks), sent_from

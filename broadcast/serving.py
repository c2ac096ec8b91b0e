"""The piece endpoint shared by the origin and relays: verified bytes only, paced by the host's uplink."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from .piece_pass import HOLD_HEADER
from .ratelimit import RateLimiter
from .store import VersionState
from .turns import TurnQueue, turn_key

log = logging.getLogger("broadcast.serving")
MAX_VERSION = 10**12
PACE_SLICE = 16 << 10  # bytes per write under an upload limit
UNSENT_LOWAT = 32 << 10  # bytes a response may leave unsent in the kernel


class Turns:
    """Waits over HTTP for turns.TurnQueue's turns. The key is the child's address and its word (X-Peer), and
    a turn is waited for as long as a held request waits for its piece: one that claims another's name from
    the same address and holds its turn delays that child's pieces from here until the child goes around us
    (piece_race.py), never past that bound. (A bound of 5 s was about one piece time with 1 MiB pieces at
    1.6 Mbit/s per child, and undid the turns there.) Given up waiting, a request is sent alongside."""

    def __init__(self) -> None:
        self.queue = TurnQueue()

    @contextlib.asynccontextmanager
    async def turn(self, child: str, index: int, trees: int, max_wait: float) -> AsyncIterator[None]:
        key = turn_key(child, index, trees)
        me: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            if not self.queue.arrive(key, me):
                try:
                    await asyncio.wait_for(asyncio.shield(me), max_wait)
                except TimeoutError:
                    if not me.done():  # its turn is overdue: sent alongside the one ahead
                        self.queue.leave(key, me)
            yield
        finally:
            nxt = self.queue.leave(key, me)
            if isinstance(nxt, asyncio.Future) and not nxt.done():
                nxt.set_result(None)


def parse_int(text: str, hi: int, what: str) -> int:
    if not text.isdigit() or len(text) > 13 or int(text) > hi:
        raise web.HTTPBadRequest(text=f"bad {what} {text[:20]!r}")
    return int(text)


async def serve_piece(
    request: web.Request,
    lookup: Callable[[int], Awaitable[VersionState | None]],
    limiter: RateLimiter,
    wait_timeout: float,
    turns: Turns,
    trees: int,
    on_sent: Callable[[int], None] | None = None,
    pace: Callable[[int], float] | None = None,
) -> web.StreamResponse:
    """`pace`: told each slice sent, says how long to wait before the next (uplink_share.py)."""
    version = parse_int(request.match_info["version"], MAX_VERSION, "version")
    st = await lookup(version)
    if st is None:
        raise web.HTTPNotFound(text=f"version {version} not held here")
    index = parse_int(request.match_info["index"], len(st.pieces) - 1, "piece index")
    if st.abandoned:
        raise web.HTTPNotFound(text=f"version {version} dropped here")
    if request.headers.get(HOLD_HEADER) == "0" and not st.have[index]:  # a helper is asked: now or not at all
        raise web.HTTPNotFound(text=f"v{version} piece {index} not here yet")
    ref = st.pieces[index]
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = ref.size
    # Answer at once, even for a piece still on its way here (pipelining: the request is held until it is
    # verified): the child sees this source is alive, and can tell it from one that never answers.
    try:
        await resp.prepare(request)
    except ConnectionError:  # the child gave up already (it got the piece elsewhere)
        return resp
    if not await st.wait_piece(index, wait_timeout):
        log.info("v%d piece %d did not arrive in %.0fs; cutting the answer short", version, index, wait_timeout)
        resp.force_close()
        return resp
    child = f"{request.remote} {request.headers.get('X-Peer', '')}"
    _low_unsent(request)
    try:
        async with turns.turn(child, index, trees, wait_timeout):
            await _send(resp, st, index, limiter, on_sent, pace)
    except FileNotFoundError:
        # Retention removed it mid-send; the child sees a short body and goes elsewhere.
        log.info("v%d piece %d vanished while serving", version, index)
        raise
    except ConnectionError:  # reset, or aiohttp's "Connection lost": the child went away (got it elsewhere)
        log.debug("child hung up during v%d piece %d", version, index)
        return resp
    await resp.write_eof()
    return resp


def _low_unsent(request: web.Request) -> None:
    """Keep little of a response unsent in the kernel (TCP_NOTSENT_LOWAT): a whole piece written into the
    socket's buffer has left our hands, and turns (above) would order only the copying."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    opt = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is not None and opt is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, opt, UNSENT_LOWAT)


async def _send(resp: web.StreamResponse, st: VersionState, index: int, limiter: RateLimiter,
                on_sent: Callable[[int], None] | None, pace: Callable[[int], float] | None) -> None:
    for chunk in st.read_chunks(index):
        # Under an upload limit, in slices at the limit's pace, as a link delivers them: a child times our
        # uplink by its bytes' arrival (receive_meter.py), and a whole piece at once would be a burst.
        step = PACE_SLICE if limiter.rate or pace else len(chunk)
        for k in range(0, len(chunk), step):
            part = chunk[k:k + step]
            await limiter.acquire(len(part))
            await resp.write(part)
            if on_sent:
                on_sent(len(part))
            if pace and (wait := pace(len(part))) > 0:
                await asyncio.sleep(wait)

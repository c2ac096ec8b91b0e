"""The piece endpoint shared by the origin and relays: verified bytes only, paced by the host's uplink."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from .ratelimit import RateLimiter
from .store import VersionState

log = logging.getLogger("broadcast.serving")
MAX_VERSION = 10**12
PACE_SLICE = 16 << 10  # bytes per write under an upload limit


def parse_int(text: str, hi: int, what: str) -> int:
    if not text.isdigit() or len(text) > 13 or int(text) > hi:
        raise web.HTTPBadRequest(text=f"bad {what} {text[:20]!r}")
    return int(text)


async def serve_piece(
    request: web.Request,
    lookup: Callable[[int], Awaitable[VersionState | None]],
    limiter: RateLimiter,
    wait_timeout: float,
    on_sent: Callable[[int], None] | None = None,
) -> web.StreamResponse:
    version = parse_int(request.match_info["version"], MAX_VERSION, "version")
    st = await lookup(version)
    if st is None:
        raise web.HTTPNotFound(text=f"version {version} not held here")
    index = parse_int(request.match_info["index"], len(st.pieces) - 1, "piece index")
    if st.abandoned:
        raise web.HTTPNotFound(text=f"version {version} dropped here")
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
    try:
        for chunk in st.read_chunks(index):
            # Under an upload limit, in slices at the limit's pace, as a link delivers them: a child times
            # our uplink by its bytes' arrival (receive_meter.py), and a whole piece at once would be a burst.
            step = PACE_SLICE if limiter.rate else len(chunk)
            for k in range(0, len(chunk), step):
                part = chunk[k:k + step]
                await limiter.acquire(len(part))
                await resp.write(part)
                if on_sent:
                    on_sent(len(part))
    except FileNotFoundError:
        # Retention removed it mid-send; the child sees a short body and goes elsewhere.
        log.info("v%d piece %d vanished while serving", version, index)
        raise
    except ConnectionError:  # reset, or aiohttp's "Connection lost": the child went away (got it elsewhere)
        log.debug("child hung up during v%d piece %d", version, index)
        return resp
    await resp.write_eof()
    return resp

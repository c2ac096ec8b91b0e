"""aiohttp helpers: serving an app on host:port and learning the port it got (port 0 = any free one);
reading a bounded response body whole."""

from __future__ import annotations

from aiohttp import StreamReader, web


async def start_site(app: web.Application, host: str, port: int,
                     shutdown_timeout: float = 60.0) -> tuple[web.AppRunner, int]:
    """Start `app`; returns its runner (cleanup() stops it) and the bound port. On failure nothing is left."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def read_capped(stream: StreamReader, cap: int) -> bytes:
    """The whole body if it is at most `cap` bytes, else its first cap+1 (so the caller sees it was too big).
    StreamReader.read(n) returns only what has arrived so far: over loopback that is usually the whole body,
    across a real network often just its first segments."""
    buf = bytearray()
    while len(buf) <= cap:
        chunk = await stream.read(cap + 1 - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)

"""Serving an aiohttp app on host:port and learning the port it got (port 0 = any free one)."""

from __future__ import annotations

from aiohttp import web


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

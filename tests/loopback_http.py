"""A test's aiohttp app on a free loopback port: the stand-in sources and attackers of the relay tree's tests."""

from __future__ import annotations

from aiohttp import web


async def serve_loopback(app: web.Application, **runner_kwargs) -> tuple[web.AppRunner, int]:
    """Start `app` on 127.0.0.1 at a port the kernel picks; returns its runner (to clean up) and the port."""
    runner = web.AppRunner(app, shutdown_timeout=0.1, **runner_kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

"""The trainer's HTTP side (aiohttp): the run's figures as JSON and Prometheus metrics."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from swarm_common.http import start_site
from trainer.stats import RunStats


def make_app(stats: RunStats, extra: Callable[[web.Application], None] | None = None) -> web.Application:
    app = web.Application()

    async def summary(_):
        return web.Response(body=msgspec.json.encode(stats.summary()), content_type="application/json")

    async def metrics(_):
        stats.summary()  # refreshes the node-state gauges
        body = generate_latest(stats.prom_registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/api/summary", summary)
    app.router.add_get("/metrics", metrics)
    if extra is not None:
        extra(app)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner, _ = await start_site(app, host, port)
    return runner

"""The trainer's live web view: one page, its JSON API and a server-sent-events stream.

A ticker samples RunStats once a second (cumulative accepted tokens and groups, per node) and wakes
every open `/events` stream. A stream starts with a full `snapshot` (the whole throughput history,
every step and eval) and then sends one `tick` a second with the newest throughput point, the steps
and evals added since, and the current overview (counts, node table, relay tree). A browser that
reconnects gets a fresh snapshot, so it never has to patch holes.

The same figures are JSON under /api (view, throughput, nodes, tree; plus the trainer's /api/summary)
and Prometheus text at /metrics, on the web port and, for the API, on the trainer's HTTP port too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from swarm_common.http import start_site
from trainer.http_api import make_app
from trainer.stats import RATE_WINDOW_S, EvalRow, Overview, RunStats, StepRow, round3

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


class NodeSeries(msgspec.Struct):
    name: str
    tokens_per_s: list[float | None]  # None before the node joined
    rollouts_per_s: list[float | None]


class Throughput(msgspec.Struct):
    window_s: float
    t: list[float]  # unix times, one a second
    tokens_per_s: list[float]
    rollouts_per_s: list[float]
    nodes: dict[str, NodeSeries]  # by node_id


class Point(msgspec.Struct):
    t: float
    tokens_per_s: float
    rollouts_per_s: float
    nodes: dict[str, tuple[float, float]]  # node_id -> (tokens/s, rollouts/s)


class View(msgspec.Struct):
    overview: Overview
    throughput: Throughput
    steps: list[StepRow]
    evals: list[EvalRow]


class Tick(msgspec.Struct):
    overview: Overview
    point: Point | None
    steps: list[StepRow]  # added since the previous message on this stream
    evals: list[EvalRow]


class WebView:
    def __init__(self, stats: RunStats, sample_s: float = 1.0, window_s: float = RATE_WINDOW_S):
        self.stats = stats
        self.sample_s, self.window_s = sample_s, window_s
        self._tick = asyncio.Condition()
        self._closing = False
        self._sampler: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    # ---- figures ----------------------------------------------------------------------------------

    def point(self, i: int = -1) -> Point | None:
        h = self.stats.history
        if not h:
            return None
        i = i % len(h)
        tok, grp, nodes = self.stats.rates(i, self.window_s)
        return Point(h[i].t, round3(tok), round3(grp), {n: (round3(a), round3(b)) for n, (a, b) in nodes.items()})

    def throughput(self) -> Throughput:
        h = self.stats.history
        pts = [self.point(i) for i in range(len(h))]
        series: dict[str, NodeSeries] = {}
        for k, p in enumerate(pts):
            for n, (tok, grp) in p.nodes.items():
                if n not in series:
                    ns = self.stats.registry.get(n)
                    series[n] = NodeSeries(ns.name if ns else n[:8], [None] * len(pts), [None] * len(pts))
                series[n].tokens_per_s[k], series[n].rollouts_per_s[k] = tok, grp
        return Throughput(self.window_s, [p.t for p in pts], [p.tokens_per_s for p in pts],
                          [p.rollouts_per_s for p in pts], series)

    def overview(self) -> Overview:
        return self.stats.overview(self.window_s)

    def view(self) -> View:
        return View(self.overview(), self.throughput(), list(self.stats.steps), list(self.stats.evals))

    # ---- HTTP ---------------------------------------------------------------------------------------

    def add_api(self, app: web.Application) -> None:
        def js(obj) -> web.Response:
            return web.Response(body=msgspec.json.encode(obj), content_type="application/json")

        def route(path: str, figures: Callable[[], Any]) -> None:
            async def handler(_):
                return js(figures())

            app.router.add_get(path, handler)

        route("/api/view", self.view)
        route("/api/throughput", self.throughput)
        route("/api/nodes", lambda: self.overview().nodes)
        route("/api/tree", self.stats.tree)
        app.router.add_get("/events", self._events)

    def extra(self, then: Callable[[web.Application], None] | None = None) -> Callable[[web.Application], None]:
        """An `extra` hook for trainer.http_api.make_app: this view's API, then `then` (if any)."""
        def add(app: web.Application) -> None:
            self.add_api(app)
            if then is not None:
                then(app)

        return add

    def add_page(self, app: web.Application) -> None:
        async def index(_):
            return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

        app.router.add_get("/", index)
        app.router.add_static("/static/", STATIC)

    def make_app(self) -> web.Application:
        def extra(app: web.Application) -> None:
            self.add_api(app)
            self.add_page(app)

        return make_app(self.stats, extra)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        v = self.view()
        n_steps, n_evals = len(v.steps), len(v.evals)
        last_t = v.throughput.t[-1] if v.throughput.t else None
        try:
            await resp.write(b"retry: 2000\nevent: snapshot\ndata: " + msgspec.json.encode(v) + b"\n\n")
            while not self._closing:
                async with self._tick:
                    await self._tick.wait()
                if self._closing:
                    break
                pt = self.point()
                steps, evals = self.stats.steps, self.stats.evals
                tick = Tick(self.overview(), pt if pt is not None and pt.t != last_t else None,
                            steps[n_steps:], evals[n_evals:])
                n_steps, n_evals = len(steps), len(evals)
                last_t = pt.t if pt is not None else last_t
                await resp.write(b"event: tick\ndata: " + msgspec.json.encode(tick) + b"\n\n")
        except ConnectionResetError:
            pass  # the browser went away
        return resp

    # ---- life cycle -------------------------------------------------------------------------------

    async def notify(self) -> None:
        """Wake every open event stream: each sends one tick."""
        async with self._tick:
            self._tick.notify_all()

    async def _sample_loop(self) -> None:
        while True:
            self.stats.sample()
            await self.notify()
            await asyncio.sleep(self.sample_s)

    def start_sampler(self) -> None:
        if self._sampler is None:
            self._sampler = asyncio.create_task(self._sample_loop())

    async def start(self, host: str, port: int) -> str | None:
        """Sample, and serve the page on host:port (0: any free port; negative: no page). Returns its URL.

        A port already taken costs the page, not the run: training goes on and the API stays on the
        trainer's HTTP port."""
        self.start_sampler()
        if port < 0:
            return None
        try:
            self._runner, port = await start_site(self.make_app(), host, port, shutdown_timeout=1.0)
        except OSError as e:
            log.warning("web view not served: cannot listen on %s:%d (%s); pass --web-port", host, port, e)
            return None
        self.url = f"http://{host}:{port}/"
        return self.url

    async def stop(self) -> None:
        self._closing = True
        await self.notify()  # ends open event streams
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        if self._runner is not None:
            await self._runner.cleanup()

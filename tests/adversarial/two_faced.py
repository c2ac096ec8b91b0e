"""Issue 29's tree attackers (run through tree_attacker.py): two-faced relays that pass the origin's checks
and harm everyone else, and leeches. See tree_attacker.py's docstring for the modes. Imports nothing of
ours but the attackers' own wire (attacker_wire.py)."""

from __future__ import annotations

import asyncio
import secrets

import aiohttp
from aiohttp import web
from attacker_wire import HB, Identity, host, join, pass_for, post, serve, stdin_line


class TwoFaced:
    """See the module's docstring. `trickle`: bytes every 0.5 s to others (0: answer and send nothing)."""

    def __init__(self, s: aiohttp.ClientSession, tracker: str, trickle: int):
        self.s, self.tracker, self.trickle = s, tracker, trickle
        self.ident = Identity()
        self.checks = self.served = 0
        self.smart = False
        self.has_children = False
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.url = ""

    async def _real(self, v: str, i: str) -> bytes | None:
        async with self.s.get(f"{self.tracker}/v/{v}/piece/{i}", headers=pass_for(self.ident, v, i)) as r:
            return await r.read() if r.status == 200 else None

    async def start(self) -> None:
        async def piece(request: web.Request) -> web.StreamResponse:
            v, i = request.match_info["v"], request.match_info["i"]
            if "X-Peer" not in request.headers or self.smart and not self.has_children:
                self.checks += 1
                body = await self._real(v, i)
                return web.Response(body=body) if body is not None else web.Response(status=404)
            self.served += 1
            resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            await resp.prepare(request)
            body = await self._real(v, i) if self.trickle else None
            if body is None:
                await asyncio.sleep(3600)
            for k in range(0, len(body), self.trickle):
                await resp.write(body[k:k + self.trickle])
                await asyncio.sleep(0.5)
            await resp.write_eof()
            return resp

        async def reach(request: web.Request) -> web.Response:
            return web.json_response(self.ident.reach(request.query.get("nonce", "")))

        async def probe(request: web.Request) -> web.Response:
            return web.Response(body=bytes(1 << 20))

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app = web.Application()
        app.add_routes([web.get("/reach", reach), web.get("/health", ok), web.get("/probe", probe),
                        web.get("/v/{v}/piece/{i}", piece)])
        self.runner, self.port = await serve(app)
        self.url = f"http://{host()}:{self.port}"
        while await join(self.s, self.tracker, self.ident, relay=True, port=self.port, name="twofaced") == 429:
            await asyncio.sleep(0.3)


async def two_faced(s, tracker: str, n: str, trickle: int, urls: tuple[str, ...] = (), friends: bool = False) -> dict:
    smart = "smart" in urls
    urls = tuple(u for u in urls if u != "smart")
    relays = [TwoFaced(s, tracker, trickle) for _ in range(int(n))]
    for r in relays:
        r.smart = smart
        await r.start()
    stop = asyncio.Event()
    answers: dict[str, int] = {}

    latest: list[int | None] = [None]

    async def every_hb(step) -> None:  # each loop on its own: a slow one (reports) must not starve heartbeats
        while not stop.is_set():
            await step()
            try:
                await asyncio.wait_for(stop.wait(), HB)
            except TimeoutError:
                pass

    async def watch() -> None:  # the newest version; `smart`: which of us have children
        async with s.get(f"{tracker}/latest") as resp:
            latest[0] = (await resp.json()).get("latest")
        if smart:
            async with s.get(f"{tracker}/tree") as resp:
                if resp.status != 200:  # rate-limited: as we last saw it
                    return
                kids = {p["peer_id"]: any(p["children"]) for p in (await resp.json())["peers"]}
            for r in relays:
                r.has_children = kids.get(r.ident.peer_id, False)

    async def beat() -> None:  # says it holds every version; `friends`: vouches for the others
        async def one(r: TwoFaced) -> None:
            others = [x.url for x in relays if x is not r] if friends else []
            await post(s, f"{tracker}/heartbeat", {
                "peer_id": r.ident.peer_id, "token": r.ident.token, "complete": [latest[0]] if latest[0] else [],
                "served_bytes": 1 << 34, "received": {u: 1 << 34 for u in others},
                "recent": {u: [25_000 << 20, 2.0] for u in others}})

        await asyncio.gather(*(one(r) for r in relays))

    async def report() -> None:
        for r in relays:
            for url in urls if latest[0] else ():
                code, body = await post(s, f"{tracker}/report", {
                    "peer_id": r.ident.peer_id, "token": r.ident.token, "accused_url": url, "reason": "stall",
                    "version": latest[0], "piece": 0, "detail": "no bytes"})
                key = body.get("action") if isinstance(body, dict) else f"HTTP {code}"
                answers[key] = answers.get(key, 0) + 1

    tasks = [asyncio.create_task(every_hb(step)) for step in (watch, beat, report)]
    print("READY", flush=True)
    await stdin_line()
    stop.set()
    await asyncio.gather(*tasks)
    for r in relays:
        await r.runner.cleanup()  # type: ignore[union-attr]
    return {"checks_served": sum(r.checks for r in relays), "requests_trickled": sum(r.served for r in relays),
            "answers": answers}


async def loris(s, tracker: str, n: str, *smart: str) -> dict:
    return await two_faced(s, tracker, n, 4 << 10, smart)


async def liars(s, tracker: str, n: str, *urls: str) -> dict:
    return await two_faced(s, tracker, n, 0, urls)


async def friends(s, tracker: str, n: str, *smart: str) -> dict:
    return await two_faced(s, tracker, n, 0, smart, friends=True)


async def leech(s, tracker: str, n: str) -> dict:
    stop = asyncio.Event()
    codes: dict[str, int] = {}
    got = 0

    async def one() -> None:
        nonlocal got
        while not stop.is_set():
            async with s.get(f"{tracker}/latest") as resp:
                v = (await resp.json()).get("latest")
            for i in range(10_000):
                if stop.is_set() or v is None:
                    break
                try:
                    async with s.get(f"{tracker}/v/{v}/piece/{i}", headers={"X-Peer": secrets.token_hex(8)}) as r:
                        body = await r.read()
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
                    continue
                codes[str(r.status)] = codes.get(str(r.status), 0) + 1
                if r.status in (400, 404):
                    break
                got += len(body) if r.status == 200 else 0
                if r.status == 403:
                    await asyncio.sleep(1.0)

    tasks = [asyncio.create_task(one()) for _ in range(int(n))]
    print("READY", flush=True)
    await stdin_line()
    stop.set()
    await asyncio.gather(*tasks)
    return {"codes": codes, "bytes": got}

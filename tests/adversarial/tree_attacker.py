"""The relay tree's attackers: many fresh identities, speaking only the documented HTTP protocol.

Run as a process of its own (`python tests/adversarial/tree_attacker.py MODE TRACKER [ARGS]`): it imports
nothing of ours but its own siblings (attacker_wire.py, two_faced.py), only aiohttp, cryptography and json,
and follows broadcast/identity.py's docstring (signed
joins, the connect-back's signed nonce) and the tracker's JSON messages. It prints READY once the attack is
under way, keeps it up until a line arrives on stdin, then prints one JSON line with what it saw.
  stall N          N relays that pass the connect-back and /health, then hold every piece request forever
                   (every other one answers at once, as an honest relay holding a piece on its way does)
  reports N V URL...  N members reporting each URL corrupt, stalled and dead (version V), over and over
  hijack URL...    fresh keys joining with these (honest relays') addresses
  flood N          N signed joins with fresh keys, 64 at a time
  leech N          N loops fetching every piece of the newest version from the origin, without joining
  loris N [smart]  N two-faced relays (below): everyone but the origin's check is sent a piece at 8 KiB/s
  liars N [smart] URL...  N two-faced relays that send their children nothing and report each URL stalling
  friends N [smart]  N two-faced relays that say they received each other's pieces at 12.5 GB/s
A two-faced relay passes the connect-back, says it holds the newest version, serves the origin's checks
(a piece request with no X-Peer: the origin's, on the code before issue 29) the real piece, fetched from
the origin as a member, and answers the uplink probe at once with filler. With `smart` after N, it also
serves every request in full while /tree shows it has no children: only the origin asks a leaf for pieces,
so whatever headers it sends, a leaf can tell its checks.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
from aiohttp import web
from attacker_wire import HB, Identity, join, post, serve, stdin_line
from two_faced import friends, leech, liars, loris

RATE = 10.0  # reports per second, all keys together: more than twice what the tracker takes from fresh keys


class Staller:
    """A relay that passes the connect-back (it signs the nonce) and answers /health, then holds every
    piece request open: it never answers, or (`answer`) answers at once and never sends a byte."""

    def __init__(self, ident: Identity, answer: bool = False):
        self.ident = ident
        self.answer = answer
        self.held = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        async def reach(request: web.Request) -> web.Response:
            return web.json_response(self.ident.reach(request.query.get("nonce", "")))

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        async def piece(request: web.Request) -> web.StreamResponse:
            self.held += 1
            if self.answer:
                resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
                await resp.prepare(request)  # chunked: no length that could give it away
            await asyncio.sleep(3600)
            return web.Response()

        app = web.Application()
        app.add_routes([web.get("/reach", reach), web.get("/health", health),
                        web.get("/v/{v}/piece/{i}", piece)])
        self.runner, self.port = await serve(app)

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


async def keep_alive(s: aiohttp.ClientSession, tracker: str, idents: list[Identity], stop: asyncio.Event,
                     rejoin=None) -> None:
    while not stop.is_set():
        for i in idents:
            if i.peer_id:
                code, _ = await post(s, f"{tracker}/heartbeat", {"peer_id": i.peer_id, "token": i.token})
                if code == 404 and rejoin:
                    await rejoin(i)
        try:
            await asyncio.wait_for(stop.wait(), HB)
        except TimeoutError:
            pass



async def stall(s, tracker: str, n: str) -> dict:
    idents = [Identity() for _ in range(int(n))]
    stallers = [Staller(x, answer=k % 2 == 1) for k, x in enumerate(idents)]
    joined = 0
    for st in stallers:
        await st.start()
        while (code := await join(s, tracker, st.ident, relay=True, port=st.port, name="staller")) == 429:
            await asyncio.sleep(0.3)
        joined += code == 200
    stop = asyncio.Event()

    async def rejoin(i: Identity) -> None:
        st = next(x for x in stallers if x.ident is i)
        await join(s, tracker, i, relay=True, port=st.port, name="staller")

    hb = asyncio.create_task(keep_alive(s, tracker, idents, stop, rejoin))
    print("READY", flush=True)
    await stdin_line()
    stop.set()
    await hb
    for st in stallers:
        await st.stop()
    return {"joined": joined, "held": sum(st.held for st in stallers)}


async def reports(s, tracker: str, n: str, version: str, *urls: str) -> dict:
    idents = [Identity() for _ in range(int(n))]

    async def rejoin(i: Identity) -> None:
        while await join(s, tracker, i, name="reporter") == 429:
            await asyncio.sleep(0.3)

    for i in idents:
        await rejoin(i)
    stop = asyncio.Event()
    hb = asyncio.create_task(keep_alive(s, tracker, idents, stop, rejoin))
    sent, answers = 0, {}

    async def storm() -> None:
        nonlocal sent
        while not stop.is_set():
            await asyncio.sleep(1 / RATE)
            for reason in ("corrupt", "stall", "dead"):
                for k, i in enumerate(idents):
                    for url in urls:
                        sent += 1
                        code, body = await post(s, f"{tracker}/report", {
                            "peer_id": i.peer_id, "token": i.token, "accused_url": url, "reason": reason,
                            "version": int(version), "piece": k % 8, "detail": "trust me"})
                        key = body.get("action") if isinstance(body, dict) else f"HTTP {code}"
                        answers[key] = answers.get(key, 0) + 1
                        if stop.is_set():
                            return
                        await asyncio.sleep(1 / RATE)

    task = asyncio.create_task(storm())
    print("READY", flush=True)
    await stdin_line()
    stop.set()
    await asyncio.gather(task, hb)
    return {"sent": sent, "answers": answers}


async def hijack(s, tracker: str, *urls: str) -> dict:
    print("READY", flush=True)
    codes: dict[str, int] = {}
    for url in urls:
        for _ in range(2):
            code = await join(s, tracker, Identity(), url=url, relay=True, name="hijacker")
            codes[str(code)] = codes.get(str(code), 0) + 1
            await asyncio.sleep(0.3)
    await stdin_line()
    return {"codes": codes}


async def flood(s, tracker: str, n: str) -> dict:
    sem = asyncio.Semaphore(64)
    codes: dict[str, int] = {}

    async def one(k: int) -> None:
        async with sem:
            try:
                code = await join(s, tracker, Identity(), name=f"flood{k}")
            except (TimeoutError, aiohttp.ClientError, OSError) as e:  # a loaded machine: count it, go on
                code = type(e).__name__
            codes[str(code)] = codes.get(str(code), 0) + 1

    print("READY", flush=True)
    t0 = time.monotonic()
    await asyncio.gather(*(one(k) for k in range(int(n))))
    secs = time.monotonic() - t0
    await stdin_line()
    return {"codes": codes, "seconds": round(secs, 2)}


async def main(mode: str, tracker: str, *args: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        out = await {"stall": stall, "reports": reports, "hijack": hijack, "flood": flood, "leech": leech, "loris": loris,
                     "liars": liars, "friends": friends}[mode](s, tracker, *args)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))

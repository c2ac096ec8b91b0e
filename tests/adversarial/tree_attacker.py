"""The relay tree's attackers: many fresh identities, speaking only the documented HTTP protocol.

Run as a process of its own (`python tests/adversarial/tree_attacker.py MODE TRACKER [ARGS]`): it imports
nothing of ours, only aiohttp, cryptography and json, and follows broadcast/identity.py's docstring (signed
joins, the connect-back's signed nonce) and the tracker's JSON messages. It prints READY once the attack is
under way, keeps it up until a line arrives on stdin, then prints one JSON line with what it saw.
  stall N          N relays that pass the connect-back and /health, then hold every piece request forever
                   (every other one answers at once, as an honest relay holding a piece on its way does)
  reports N V URL...  N members reporting each URL corrupt, stalled and dead (version V), over and over
  hijack URL...    fresh keys joining with these (honest relays') addresses
  flood N          N signed joins with fresh keys, 64 at a time
  leech N          N loops fetching every piece of the newest version from the origin, without joining
  loris N          N two-faced relays (below): everyone but the origin's check is sent a piece at 8 KiB/s
  liars N URL...   N two-faced relays that send their children nothing and report each URL stalling
  friends N        N two-faced relays that say they received each other's pieces at 12.5 GB/s
A two-faced relay passes the connect-back, says it holds the newest version, serves the origin's checks
(a piece request with no X-Peer: the origin's, on the code before issue 29) the real piece, fetched from
the origin as a member, and answers the uplink probe at once with filler.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import sys
import time

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

JOIN_DOMAIN = b"rollout-swarm/join/v1\n"
REACH_DOMAIN = b"rollout-swarm/reach/v1\n"
HB = 0.3
RATE = 10.0  # reports per second, all keys together: more than twice what the tracker takes from fresh keys


class Identity:
    """A fresh ed25519 key: free, as the issue says."""

    def __init__(self) -> None:
        self.sk = Ed25519PrivateKey.generate()
        self.pub = self.sk.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
        self.peer_id = self.token = ""

    def join_body(self, url: str | None, relay: bool, name: str, port: int | None = None) -> bytes:
        msg = {"url": url, "relay": relay, "name": name, "key": self.pub, "port": port,
               "time_ms": int(time.time() * 1000), "nonce": secrets.token_hex(16), "signature": ""}
        payload = JOIN_DOMAIN + json.dumps(msg, separators=(",", ":")).encode()
        msg["signature"] = self.sk.sign(payload).hex()
        return json.dumps(msg, separators=(",", ":")).encode()

    def reach(self, nonce: str) -> dict:
        return {"key": self.pub, "signature": self.sk.sign(REACH_DOMAIN + nonce.encode()).hex()}


async def post(s: aiohttp.ClientSession, url: str, body: bytes | dict) -> tuple[int, dict | str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def join(s: aiohttp.ClientSession, tracker: str, ident: Identity, url: str | None = None,
               relay: bool = False, port: int | None = None, name: str = "evil") -> int:
    status, body = await post(s, f"{tracker}/join", ident.join_body(url, relay, name, port))
    if status == 200 and isinstance(body, dict):
        ident.peer_id, ident.token = body["peer_id"], body["token"]
    return status


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
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

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



async def stdin_line() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


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


def pass_for(ident: Identity, v: int | str, i: int | str) -> dict:
    """A member's headers for piece v/i: its id and an HMAC of its token over the piece's name."""
    mac = hmac.new(ident.token.encode(), f"piece {v}/{i}".encode(), hashlib.sha256).hexdigest()[:32]
    return {"X-Peer": ident.peer_id, "X-Peer-Pass": mac}


class TwoFaced:
    """See the module's docstring. `trickle`: bytes every 0.5 s to others (0: answer and send nothing)."""

    def __init__(self, s: aiohttp.ClientSession, tracker: str, trickle: int):
        self.s, self.tracker, self.trickle = s, tracker, trickle
        self.ident = Identity()
        self.checks = self.served = 0
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.url = ""

    async def _real(self, v: str, i: str) -> bytes | None:
        async with self.s.get(f"{self.tracker}/v/{v}/piece/{i}", headers=pass_for(self.ident, v, i)) as r:
            return await r.read() if r.status == 200 else None

    async def start(self) -> None:
        async def piece(request: web.Request) -> web.StreamResponse:
            v, i = request.match_info["v"], request.match_info["i"]
            if "X-Peer" not in request.headers:
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
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self.port}"
        while await join(self.s, self.tracker, self.ident, relay=True, port=self.port, name="twofaced") == 429:
            await asyncio.sleep(0.3)


async def two_faced(s, tracker: str, n: str, trickle: int, urls: tuple[str, ...] = (), friends: bool = False) -> dict:
    relays = [TwoFaced(s, tracker, trickle) for _ in range(int(n))]
    for r in relays:
        await r.start()
    stop = asyncio.Event()
    answers: dict[str, int] = {}

    async def beat() -> None:  # says it holds every version; `friends`: vouches for the others
        while not stop.is_set():
            async with s.get(f"{tracker}/latest") as resp:
                latest = (await resp.json()).get("latest")
            for r in relays:
                others = [x.url for x in relays if x is not r] if friends else []
                await post(s, f"{tracker}/heartbeat", {
                    "peer_id": r.ident.peer_id, "token": r.ident.token, "complete": [latest] if latest else [],
                    "served_bytes": 1 << 34, "received": {u: 1 << 34 for u in others},
                    "recent": {u: [25_000 << 20, 2.0] for u in others}})
                for url in urls if latest else ():
                    code, body = await post(s, f"{tracker}/report", {
                        "peer_id": r.ident.peer_id, "token": r.ident.token, "accused_url": url, "reason": "stall",
                        "version": latest, "piece": 0, "detail": "no bytes"})
                    key = body.get("action") if isinstance(body, dict) else f"HTTP {code}"
                    answers[key] = answers.get(key, 0) + 1
            try:
                await asyncio.wait_for(stop.wait(), HB)
            except TimeoutError:
                pass

    task = asyncio.create_task(beat())
    print("READY", flush=True)
    await stdin_line()
    stop.set()
    await task
    for r in relays:
        await r.runner.cleanup()  # type: ignore[union-attr]
    return {"checks_served": sum(r.checks for r in relays), "requests_trickled": sum(r.served for r in relays),
            "answers": answers}


async def loris(s, tracker: str, n: str) -> dict:
    return await two_faced(s, tracker, n, 4 << 10)


async def liars(s, tracker: str, n: str, *urls: str) -> dict:
    return await two_faced(s, tracker, n, 0, urls)


async def friends(s, tracker: str, n: str) -> dict:
    return await two_faced(s, tracker, n, 0, friends=True)


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


async def main(mode: str, tracker: str, *args: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        out = await {"stall": stall, "reports": reports, "hijack": hijack, "flood": flood, "leech": leech, "loris": loris,
                     "liars": liars, "friends": friends}[mode](s, tracker, *args)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))

"""`swarm doctor --trainer HOST:PORT`: what a GPU owner runs when something is wrong.

Each check prints one line: ok / FAIL / warn, what was found, and what to do. It registers nothing with
the trainer (the node's own key says Hello, or a throwaway key where the node has none yet: the trainer
says where the key stands, and whether a key on probation can be paired there), downloads one manifest
and one piece, and asks the tracker to connect back to this machine's relay port.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from broadcast.identity import reach_answer
from broadcast.manifest import ManifestError, decode_manifest, flat_pieces
from broadcast.messages import ReachTest
from swarm_common import protocol as P
from swarm_common.http import read_capped, start_site
from swarm_common.keys import KeyPair, fingerprint, load_public


@dataclass
class Check:
    name: str
    ok: bool | None  # None: a warning, not a failure
    found: str
    todo: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL" if self.ok is False else "warn"
        return f"[{mark}] {self.name:<12} {self.found}" + (f"\n       -> {self.todo}" if self.todo else "")


async def _hello(endpoint: str, host: str, timeout: float, key: KeyPair) -> P.Welcome | P.Error | None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(P.sign(P.Hello(node_id=key.public_hex, trainer_host=host), key))
        async with asyncio.timeout(timeout):
            while True:
                msg = P.decode(await sock.recv())
                if isinstance(msg, P.Welcome | P.Error):
                    return msg
    except TimeoutError:
        return None
    finally:
        sock.close(0)
        ctx.term()


async def _get(session: aiohttp.ClientSession, url: str, limit: int) -> tuple[int, bytes, float]:
    """GET the whole body (at most `limit` bytes), and how long it took."""
    t0 = time.perf_counter()
    async with session.get(url) as r:
        body = await read_capped(r.content, limit)
        if len(body) > limit:
            raise aiohttp.ClientPayloadError(f"{url}: more than {limit} bytes")
        return r.status, body, time.perf_counter() - t0


async def _connect_back(session: aiohttp.ClientSession, tracker: str, relay_host: str, relay_port: int) -> Check:
    """Answer /reach on the relay port as a relay would, and ask the tracker to connect back to it at the
    address it sees this machine at."""
    key = KeyPair.generate()
    app = web.Application()

    async def reach(request: web.Request) -> web.Response:
        nonce = request.query.get("nonce", "")[:128]
        return web.Response(body=msgspec.json.encode(reach_answer(nonce, key)), content_type="application/json")

    app.router.add_get("/reach", reach)
    try:
        runner, port = await start_site(app, relay_host, relay_port, shutdown_timeout=0.5)
    except OSError as e:
        return Check("relay port", False, f"cannot listen on {relay_host}:{relay_port}: {e}",
                     "free the port, or pick another with --relay-port")
    try:
        async with session.get(f"{tracker}/reach-test", params={"port": str(port)}) as r:
            body = await read_capped(r.content, 1 << 16)
            if r.status == 404:
                return Check("relay port", None, "this tracker cannot test reachability (an older trainer)")
            if r.status != 200:
                return Check("relay port", False, f"the tracker refused the test: HTTP {r.status} {body[:200]!r}")
        test = msgspec.json.decode(body, type=ReachTest)
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as e:
        return Check("relay port", False, f"the tracker did not answer the reachability test: {e}")
    finally:
        await runner.cleanup()
    if test.reachable and test.answered_key == key.public_hex:
        return Check("relay port", True, f"the tracker reached this machine at {test.url}: it can relay")
    if test.reachable:
        return Check("relay port", False, f"{test.url} answers, but not this machine: {test.detail}",
                     "another machine answers at this address and port (a NAT forwarding the port elsewhere?)")
    return Check("relay port", False, f"the tracker could not reach {test.url} ({test.detail})",
                 f"open TCP port {port} to this machine (or forward it on your router) and pass --relay-port "
                 f"{port}; or pass --advertise http://PUBLIC-ADDRESS:PORT. A node that cannot be reached still "
                 "trains, downloading only")


def _probation(hello: P.Welcome, own_key: bool) -> Check:
    """Will this machine's node have its work trained on, or wait on probation with nobody to pair it with?"""
    who = "this node's key" if own_key else "a new key"
    if hello.standing == "established":
        return Check("probation", True, f"{who} is established with this trainer: its work trains at once")
    if hello.unpaired:
        return Check("probation", None, f"{who} {'is' if hello.standing == 'probation' else 'will be'} on "
                     f"probation, and the trainer has nobody to pair it with (no reference of its own, no "
                     f"established node live): its work waits in quarantine and does not train"
                     + (f" ({hello.shared_prompts} shared prompts so far)" if own_key else ""),
                     "ask the run's operator to start the trainer with --reference, or to run a node of "
                     "their own and trust its key (--trust KEY)")
    if hello.standing == "probation":
        return Check("probation", True, f"{who} is on probation: {hello.shared_prompts} shared prompts compared "
                     "so far; its work trains once the paired test clears it")
    return Check("probation", True, f"{who} starts on probation; the trainer can pair it, so its work trains "
                 "once a few dozen shared prompts clear it")


async def diagnose(trainer: str, trainer_key: str | None = None, relay_host: str = "0.0.0.0",
                   relay_port: int = 0, timeout: float = 5.0, data_dir: str | None = None) -> list[Check]:
    endpoint = trainer if "://" in trainer else f"tcp://{trainer}"
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    checks: list[Check] = []
    # The node's own key when it has one (the trainer says where it stands), else a throwaway one.
    key_path = Path(data_dir) / "node.key" if data_dir else None
    own_key = key_path is not None and key_path.exists()
    hello = await _hello(endpoint, host, timeout, KeyPair.load_or_create(key_path) if own_key else KeyPair.generate())
    if not isinstance(hello, P.Welcome):
        why = hello.message if isinstance(hello, P.Error) else f"no answer in {timeout:.0f}s"
        checks.append(Check("trainer", False, f"{endpoint}: {why}",
                            f"check the address, that `swarm train` runs there, and that TCP port {parts.port} is "
                            "open to you (the trainer binds server.host: 0.0.0.0 serves other machines)"))
        return checks
    checks.append(Check("trainer", True, f"{endpoint} answers (protocol {hello.protocol}, policy v{hello.version}); "
                        f"it sees this machine as {hello.seen_as or '?'}"))
    checks.append(_probation(hello, own_key))
    pinned = load_public(trainer_key) if trainer_key else None
    if pinned is not None and pinned.hex() != hello.trainer_key:
        checks.append(Check("trainer key", False, f"the trainer signs with {fingerprint(hello.trainer_key)}, "
                            f"not the pinned {fingerprint(pinned)}", "ask the operator for the right key"))
        return checks
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(timeout, 30))) as session:
        api = f"http://{host}:{hello.http_port}/api/summary"
        try:
            status, _, _ = await _get(session, api, 1 << 22)
            checks.append(Check("http api", status == 200 or None, f"{api}: HTTP {status}"))
        except (aiohttp.ClientError, TimeoutError) as e:
            checks.append(Check("http api", None, f"{api} not reachable ({type(e).__name__})",
                                "only the operator needs it; nodes work without it"))
        tracker = hello.tracker_url.rstrip("/")
        try:
            status, body, _ = await _get(session, f"{tracker}/v/{hello.version}/manifest", 1 << 24)
            if status != 200:
                raise ManifestError(f"HTTP {status}")
            manifest = decode_manifest(body, bytes.fromhex(hello.trainer_key))
            checks.append(Check("tracker", True, f"{tracker} serves v{manifest.version}, signed by "
                                f"{fingerprint(hello.trainer_key)}"))
        except (aiohttp.ClientError, TimeoutError, ManifestError, msgspec.DecodeError) as e:
            checks.append(Check("tracker", False, f"{tracker}: {e}",
                                "the trainer's server.tracker_port must be open to you too; an operator behind "
                                "NAT sets server.public_host"))
            return checks
        piece = max(flat_pieces(manifest), key=lambda p: p.size)  # the largest: the rate means something
        url = f"{tracker}/v/{manifest.version}/piece/{piece.index}"
        status, data, secs = await _get(session, url, piece.size)
        if status == 200 and piece.matches(data):
            checks.append(Check("download", True, f"piece {piece.index} ({len(data) / 2**20:.2f} MiB) verified, "
                                f"{len(data) * 8 / 1e6 / max(secs, 1e-6):.1f} Mbit/s from the origin"))
        else:
            checks.append(Check("download", False, f"{url}: HTTP {status}, {len(data)} bytes that do not match "
                                "the signed manifest", "a proxy or a broken link altered the data; try another network"))
        checks.append(await _connect_back(session, tracker, relay_host, relay_port))
    return checks


def run(trainer: str, trainer_key: str | None, relay_host: str, relay_port: int, data_dir: str | None = None) -> int:
    checks = asyncio.run(diagnose(trainer, trainer_key, relay_host, relay_port, data_dir=data_dir))
    for c in checks:
        print(c.line(), flush=True)
    failed = [c for c in checks if c.ok is False]
    print("verdict: " + ("all good: `swarm node --trainer " + trainer + "` will work" if not failed
                         else f"{len(failed)} problem(s) above"))
    return 1 if failed else 0

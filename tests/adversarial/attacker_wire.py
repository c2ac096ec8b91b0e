"""What every tree attacker (tree_attacker.py, two_faced.py) speaks: fresh ed25519 identities, signed joins
and the connect-back's signed nonce as broadcast/identity.py's docstring documents them, the tracker's JSON
messages, a member's piece pass (broadcast/piece_pass.py's docstring). Imports nothing of ours."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
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


async def stdin_line() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


def pass_for(ident: Identity, v: int | str, i: int | str) -> dict:
    """A member's headers for piece v/i: its id and an HMAC of its token over the piece's name."""
    mac = hmac.new(ident.token.encode(), f"piece {v}/{i}".encode(), hashlib.sha256).hexdigest()[:32]
    return {"X-Peer": ident.peer_id, "X-Peer-Pass": mac}


def host() -> str:
    """The address attackers listen on: 127.0.0.1, or $ATTACKER_HOST (a lab host's own, across namespaces)."""
    return os.environ.get("ATTACKER_HOST", "127.0.0.1")


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """Start an attacker's app on host() at a port the kernel picks: its runner and the port."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, host(), 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

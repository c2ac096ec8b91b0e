"""A relay: a peer without an inference engine, giving its bandwidth to the tree until it is stopped.

`swarm relay` (swarm/cli.py) reads the flags and calls `run_relay`. The relay's identity in the tree is its
own ed25519 key, kept in DATA_DIR/relay.key (made on first start).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from swarm_common.keys import KeyPair, fingerprint

from .config import PeerConfig
from .peer import Peer


async def run_relay(tracker: str, data_dir: Path, trainer_key: bytes, config: PeerConfig, *,
                    exit_after: int | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or, with `exit_after`, until that version is held); returns an exit code.
    An unreachable tracker is retried (with backoff) until it answers or the relay is stopped."""
    print(f"trusting trainer key {fingerprint(trainer_key)}", flush=True)
    key = KeyPair.load_or_create(Path(data_dir) / "relay.key")
    peer = Peer(tracker, data_dir, trainer_key, config, keypair=key)

    async def announce(version: int, path: Path) -> None:
        print(f"HAVE v{version} {path}", flush=True)

    peer.on_version = announce
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(stop.wait())
    try:
        starting = asyncio.create_task(peer.start())
        await asyncio.wait([waiter, starting], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 0
        starting.result()
        where = peer.url if peer.url and peer.reachable else "(downloading only: not reachable)"
        print(f"relay {peer.peer_id} key {key.fingerprint} serving at {where}", flush=True)
        if exit_after is not None:
            done = asyncio.create_task(peer.wait_version(exit_after))
            await asyncio.wait([waiter, done], return_when=asyncio.FIRST_COMPLETED)
            if done.done() and done.exception():
                print(f"error: {done.exception()}", flush=True)
                return 1
        else:
            await waiter
    finally:
        waiter.cancel()
        await peer.stop()
    return 0

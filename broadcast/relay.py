"""A relay: a peer without an inference engine, giving its bandwidth to the tree until it is stopped.

`swarm relay` (swarm/cli.py) reads the flags and calls `run_relay`.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from swarm_common.keys import fingerprint

from .peer import Peer


async def run_relay(tracker: str, data_dir: Path, trainer_key: bytes, *, host: str = "127.0.0.1", port: int = 0,
                    relay: bool = True, keep: int = 3, upload_rate: float | None = None, name: str = "",
                    stall_timeout: float = 30.0, progress: bool = False, exit_after: int | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or, with `exit_after`, until that version is held); returns an exit code."""
    print(f"trusting trainer key {fingerprint(trainer_key)}", flush=True)
    peer = Peer(tracker, data_dir, trainer_key, host=host, port=port, relay=relay, keep=keep,
                upload_rate=upload_rate, name=name, stall_timeout=stall_timeout, progress=progress)

    async def announce(version: int, path: Path) -> None:
        print(f"HAVE v{version} {path}", flush=True)

    peer.on_version = announce
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await peer.start()
    print(f"relay {peer.peer_id} serving at {peer.url or '(no relay)'}", flush=True)
    try:
        waiter = asyncio.create_task(stop.wait())
        if exit_after is not None:
            done = asyncio.create_task(peer.wait_version(exit_after))
            await asyncio.wait([waiter, done], return_when=asyncio.FIRST_COMPLETED)
            if done.done() and done.exception():
                print(f"error: {done.exception()}", flush=True)
                return 1
        else:
            await waiter
    finally:
        await peer.stop()
    return 0

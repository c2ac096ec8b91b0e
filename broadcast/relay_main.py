"""`swarm relay`: a peer without an inference engine, giving its bandwidth to the tree."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from swarm.keys import fingerprint, load_public

from .peer import Peer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tracker", required=True, help="origin/tracker URL, e.g. http://127.0.0.1:8700")
    parser.add_argument("--trusted-key", required=True, help="trainer public key: 64 hex chars or a .pub file")
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on and advertise")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--keep", type=int, default=3, help="versions to keep on disk")
    parser.add_argument("--no-relay", action="store_true", help="download only, serve no one")
    parser.add_argument("--upload-rate", type=float, default=None, help="upload cap in bytes/s")
    parser.add_argument("--stall-timeout", type=float, default=30.0)
    parser.add_argument("--name", default="")
    parser.add_argument("--progress", action="store_true", help="show tqdm progress bars")
    parser.add_argument("--exit-after", type=int, default=None, help="exit once this version is held")


async def run(args: argparse.Namespace) -> int:
    trusted = load_public(args.trusted_key)
    print(f"trusting trainer key {fingerprint(trusted)}", flush=True)
    peer = Peer(
        args.tracker,
        args.data_dir,
        trusted,
        host=args.host,
        port=args.port,
        relay=not args.no_relay,
        keep=args.keep,
        upload_rate=args.upload_rate,
        name=args.name,
        stall_timeout=args.stall_timeout,
        progress=args.progress,
    )

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
        if args.exit_after is not None:
            done = asyncio.create_task(peer.wait_version(args.exit_after))
            await asyncio.wait([waiter, done], return_when=asyncio.FIRST_COMPLETED)
            if done.done() and done.exception():
                print(f"error: {done.exception()}", flush=True)
                return 1
        else:
            await waiter
    finally:
        await peer.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())

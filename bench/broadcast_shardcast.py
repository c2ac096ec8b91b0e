"""The shardcast row of bench/broadcast.py: PyPI shardcast's origin, ceil(sqrt(N)) middle relays and N
clients, each role in a process of its own (bench/broadcast.py --sc-role ...), its servers paced to B.
Nothing listens beyond the address given (shardcast's get_local_ip, which would open a UDP socket towards
10.x, is replaced in every process that imports it)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path


def rusage_cpu(ru) -> float:
    return ru.ru_utime + ru.ru_stime


async def stop_all(procs: list[asyncio.subprocess.Process]) -> None:
    """Tell each role process to stop (a line on its stdin: it prints its CPU and exits) and wait for all."""
    for p in procs:
        p.stdin.write(b"stop\n")
        await p.stdin.drain()
    for p in procs:
        await asyncio.wait_for(p.wait(), 20)
    await asyncio.sleep(0.1)


async def read_lines(proc: asyncio.subprocess.Process, sink: list[str]) -> None:
    assert proc.stdout
    async for line in proc.stdout:
        sink.append(line.decode().strip())


# ---------------------------------------------------------------------------------------------------------
# shardcast roles (each in its own process; its servers are single-threaded stdlib http.server)
# ---------------------------------------------------------------------------------------------------------
def _patch_shardcast(rate: float, bind: str) -> None:
    import shardcast.server as server

    server.get_local_ip = lambda: bind  # never probe towards other addresses
    lock = threading.Lock()
    state = {"next": time.monotonic()}

    def copyfile(self, source, outputfile) -> None:  # pace this server's uplink to `rate`
        while chunk := source.read(64 << 10):
            with lock:
                now = time.monotonic()
                start = max(state["next"], now - 0.02)
                state["next"] = start + len(chunk) / rate
                delay = state["next"] - now
            if delay > 0:
                time.sleep(delay)
            outputfile.write(chunk)

    if rate:  # 0: the kernel shapes this host's uplink (--netns)
        server.ShardcastRequestHandler.copyfile = copyfile
    orig_init = server.ShardcastServer.__init__

    def init(self, server_address, directory, shutdown_event=None):  # bind ours, not shardcast's 0.0.0.0
        orig_init(self, (bind, server_address[1]), directory, shutdown_event)

    server.ShardcastServer.__init__ = init


def sc_role(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    _patch_shardcast(args.rate, args.bind)
    import shardcast.utils

    shardcast.utils.logger.setLevel(logging.WARNING)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "data1.bin").write_bytes(b"\0" * 1024)  # the bandwidth probe its clients insist on
    if args.sc_role == "origin":
        from shardcast.origin_server import OriginServer

        o = OriginServer(str(d), args.port)
        print("READY", flush=True)
        sys.stdin.readline()
        print(f"T0 {time.time():.6f}", flush=True)
        o.broadcast(args.file)
        print("PUBLISHED", flush=True)
        sys.stdin.readline()
    elif args.sc_role == "middle":
        from shardcast.middle_node import MiddleNode

        MiddleNode(args.upstream, str(d), args.port, check_interval=1)
        print("READY", flush=True)
        sys.stdin.readline()
    else:
        from shardcast.client_node import ClientNode

        clients = [ClientNode(args.upstream, str(d / f"c{i}")) for i in range(args.n[0])]
        print("READY", flush=True)

        def fetch(i: int, c) -> None:
            while True:
                if "v1" in c.list_available_versions():
                    out = c.download_version("v1", str(d / f"c{i}" / "file.bin"))
                    if out:
                        print(f"DONE {i} {time.time():.6f}", flush=True)
                        return
                time.sleep(0.2)

        threads = [threading.Thread(target=fetch, args=(i, c), daemon=True) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        sys.stdin.readline()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)  # the wget processes
    print(f"CPU {rusage_cpu(ru) + rusage_cpu(ch):.3f}", flush=True)
    os._exit(0)  # its server threads block in handle_request()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_shardcast(n: int, size: int, rate: float, tmp: Path, timeout: float, script: Path) -> dict:
    """`script`: bench/broadcast.py, which runs each role (--sc-role)."""
    try:
        import shardcast  # noqa: F401
    except ImportError as e:
        return {"T": None, "error": f"shardcast not importable: {e}"}
    if not shutil.which("wget"):
        return {"T": None, "error": "wget missing (shardcast shells out to it)"}
    root = tmp / f"sc{n}"
    root.mkdir(parents=True)
    src = root / "model.bin"
    src.write_bytes(os.urandom(size))
    m = math.ceil(math.sqrt(n))
    env = dict(os.environ, SHARDCAST_FAST_RETRY_INTERVAL="1", SHARDCAST_SLOW_RETRY_INTERVAL="1")
    procs: list[asyncio.subprocess.Process] = []
    lines: list[list[str]] = []

    async def spawn(*a: str) -> tuple[asyncio.subprocess.Process, list[str]]:
        p = await asyncio.create_subprocess_exec(sys.executable, str(script), "--rate", str(rate), *a,
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                 stderr=subprocess.DEVNULL, env=env, cwd=root)
        sink: list[str] = []
        asyncio.create_task(read_lines(p, sink))
        procs.append(p)
        lines.append(sink)
        end = time.monotonic() + 60
        while "READY" not in sink:
            if p.returncode is not None or time.monotonic() > end:
                raise RuntimeError(f"shardcast {a[:2]} did not start")
            await asyncio.sleep(0.05)
        return p, sink

    try:
        oport = _free_port()
        origin, osink = await spawn("--sc-role", "origin", "--dir", str(root / "origin"), "--port", str(oport),
                                    "--file", str(src))
        ups = []
        for j in range(m):
            port = _free_port()
            await spawn("--sc-role", "middle", "--dir", str(root / f"mid{j}"), "--port", str(port),
                        "--upstream", f"http://127.0.0.1:{oport}")
            ups.append(f"http://127.0.0.1:{port}")
        _, csink = await spawn("--sc-role", "clients", "--dir", str(root / "clients"), "--n", str(n),
                               "--upstream", *ups)
        origin.stdin.write(b"go\n")
        await origin.stdin.drain()
        end = time.monotonic() + timeout
        while sum(s.startswith("DONE") for s in csink) < n:
            if time.monotonic() > end:
                got = sum(s.startswith("DONE") for s in csink)
                return {"T": None, "error": f"timeout after {timeout:.0f}s with {got}/{n} done", "relays": m}
            await asyncio.sleep(0.05)
        t0 = float(next(s for s in osink if s.startswith("T0")).split()[1])
        T = max(float(s.split()[2]) for s in csink if s.startswith("DONE")) - t0
        await stop_all(procs)
        cpu = sum(float(s.split()[1]) for sink in lines for s in sink if s.startswith("CPU "))
        for i in range(n):
            if (root / "clients" / f"c{i}" / "file.bin").read_bytes() != src.read_bytes():
                return {"T": None, "error": f"client {i} holds different bytes"}
        return {"T": T, "cpu_s": cpu, "cpu_frac_of_2_cores": cpu / T / 2, "relays": m}
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()



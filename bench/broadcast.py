"""Benchmark: deliver one version of S bytes to N receivers on loopback, every uplink paced to B bytes/s.

Reports T / (S/B) for three designs with the same S, B and N:
  tree       broadcast/ (k SplitStream trees, pipelined verified pieces, every peer relays)
  star       every receiver fetches from the origin (floor N*S/B)
  shardcast  PyPI shardcast: origin + ceil(sqrt(N)) middle relays + N clients, its servers paced to B
Each host's uplink is emulated by a rate limiter in the sender, so one machine stands in for many hosts.
Peers run several to a process (each Peer has its own limiter) so two cores aren't the bottleneck; CPU
use is measured and printed. Nothing listens or connects beyond 127.0.0.1 (shardcast's get_local_ip,
which would open a UDP socket towards 10.x, is replaced in every process that imports it).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.broadcast_netns import finish_row  # noqa: E402  (the table's rows, as --netns fills them)
from bench.broadcast_shardcast import read_lines, run_shardcast, rusage_cpu, sc_role, stop_all  # noqa: E402

MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------------
# tree / star: a worker process hosting several peers
# ---------------------------------------------------------------------------------------------------------
async def _peer_worker(args: argparse.Namespace) -> None:
    from broadcast.peer import Peer, PeerConfig

    logging.basicConfig(level=logging.WARNING)
    peers = []

    def on_done(i: int):
        async def cb(version: int, path: Path) -> None:
            bypasses = peers[args.indices.index(i)].bypasses  # pieces asked of an ancestor in parallel
            print(f"DONE {i} {time.time():.6f} {bypasses}", flush=True)

        return cb

    for i in args.indices:
        cfg = PeerConfig(relay=not args.no_relay, relay_host=args.bind, upload_rate=args.rate or 0.0, name=f"p{i}",
                         window=args.window, stall_timeout=60)
        p = Peer(args.tracker, Path(args.dir) / f"p{i}", bytes.fromhex(args.key), cfg, on_version=on_done(i))
        await p.start()
        peers.append(p)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"CPU0 {ru.ru_utime + ru.ru_stime:.3f}", flush=True)  # start-up cost, excluded from the figure
    prof = cProfile.Profile(time.thread_time) if os.environ.get("BENCH_PROFILE") else None  # relay_cpu.py
    if prof:
        prof.enable()
    print("READY", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # parent says stop
    if prof:
        prof.disable()
        prof.dump_stats(f"{os.environ['BENCH_PROFILE']}-{args.indices[0]}.prof")
    for p in peers:
        await p.stop()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"CPU {ru.ru_utime + ru.ru_stime:.3f}", flush=True)


async def run_ours(mode: str, n: int, size: int, rate: float, piece: int, trees: int, workers: int,
                   window: int, tmp: Path, timeout: float) -> dict:
    from broadcast.config import OriginConfig
    from broadcast.origin import Origin
    from swarm_common.keys import KeyPair

    kp = KeyPair.generate()
    root = tmp / f"{mode}{n}"
    origin = Origin(root / "origin", kp, OriginConfig(fanout=trees, upload_rate=rate, piece_bytes=piece,
                                                      heartbeat_s=1.0))
    await origin.start()
    procs, lines = [], []
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        nw = min(workers, n)
        for w in range(nw):
            idx = [str(i) for i in range(w, n, nw)]
            cmd = [sys.executable, __file__, "--peer-worker", "--tracker", origin.url, "--key", kp.public_hex,
                   "--dir", str(root), "--rate", str(rate), "--window", str(window), "--indices", *idx]
            if mode == "star":
                cmd.append("--no-relay")
            p = await asyncio.create_subprocess_exec(*cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            procs.append(p)
            sink: list[str] = []
            lines.append(sink)
            asyncio.create_task(read_lines(p, sink))
        end = time.monotonic() + 60
        while sum("READY" in s for sink in lines for s in sink) < nw or len(origin.tracker.peers) < n:
            if time.monotonic() > end:
                raise RuntimeError("peers did not start")
            await asyncio.sleep(0.1)
        vdir = root / "origin" / "v1"
        vdir.mkdir(parents=True)
        (vdir / "model.safetensors").write_bytes(os.urandom(size))
        t0 = time.time()
        cpu_t0 = resource.getrusage(resource.RUSAGE_SELF)
        await origin.publish(vdir, 1, None)
        end = time.monotonic() + timeout
        done: dict[str, float] = {}
        while len(done) < n:
            for sink in lines:
                for s in sink:
                    if s.startswith("DONE "):
                        _, i, t = s.split()[:3]
                        done[i] = float(t)
            if time.monotonic() > end:
                return {"T": None, "error": f"timeout after {timeout:.0f}s with {len(done)}/{n} done"}
            await asyncio.sleep(0.05)
        T = max(done.values()) - t0
        first = min(done.values()) - t0
        own = rusage_cpu(resource.getrusage(resource.RUSAGE_SELF)) - rusage_cpu(cpu_t0)
        await stop_all(procs)
        worker_cpu = sum(float(s.split()[1]) for sink in lines for s in sink if s.startswith("CPU ")) - sum(
            float(s.split()[1]) for sink in lines for s in sink if s.startswith("CPU0 "))
        for i in range(n):
            got = (root / f"p{i}" / "versions" / "v1" / "model.safetensors").read_bytes()
            if got != (vdir / "model.safetensors").read_bytes():
                return {"T": None, "error": f"p{i} holds different bytes"}
        return {"T": T, "first_s": first, "cpu_s": own + worker_cpu, "cpu_frac_of_2_cores": (own + worker_cpu) / T / 2,
                "peers_cpu_s": worker_cpu, "origin_cpu_s": own}
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await origin.stop()
        del cpu0


# ---------------------------------------------------------------------------------------------------------
async def bench(args: argparse.Namespace) -> dict:
    size, rate = int(args.size_mib * MiB), args.rate_mib * MiB
    floor = size / rate
    results = {"S_bytes": size, "B_bytes_per_s": rate, "floor_s": floor, "piece_bytes": args.piece_kib << 10,
               "trees": args.trees, "rows": []}
    print(f"S = {size / MiB:.1f} MiB, B = {rate / MiB:.2f} MiB/s per uplink, S/B = {floor:.2f} s, "
          f"pieces of {args.piece_kib} KiB, {args.trees} trees, peers over {args.workers} processes")
    print(f"{'N':>3} {'design':<10} {'T (s)':>8} {'T/(S/B)':>8} {'floor':>10} {'CPU (of 2 cores)':>17}  note")
    with tempfile.TemporaryDirectory(prefix="bcbench-") as td:
        tmp = Path(td)
        for n in args.n:
            for design in args.designs:
                budget = {"tree": 4 * floor + 30, "star": 1.5 * n * floor + 30,
                          "shardcast": 1.5 * n * floor + 30}[design]  # worse than the star = timeout
                t_start = time.monotonic()
                try:
                    if design == "shardcast":
                        r = await run_shardcast(n, size, rate, tmp, budget, Path(__file__))
                    else:
                        r = await run_ours(design, n, size, rate, args.piece_kib << 10, args.trees, args.workers,
                                           args.window, tmp, budget)
                except Exception as e:  # a failed row is reported, not fatal to the table
                    r = {"T": None, "error": f"{type(e).__name__}: {e}"}
                finish_row(results, r, n, design, t_start, floor)
                note = r.get("error", "") or (f"first receiver done at {r['first_s']:.2f}s" if "first_s" in r else "")
                if design == "shardcast" and "relays" in r:
                    note = f"origin + {r['relays']} middle relays; clients never upload. {note}"
                print(f"{n:>3} {design:<10} {_f(r['T'], 8, 2)} {_f(r['ratio'], 8, 2)} "
                      f"{'N·S/B' if design == 'star' else 'S/B':>10} {_f(r.get('cpu_frac_of_2_cores'), 16, 0, 100)}%"
                      f"  {note}", flush=True)
    return results


def _f(x, w: int, d: int, scale: float = 1) -> str:
    return f"{x * scale:>{w}.{d}f}" if isinstance(x, (int, float)) else f"{'—':>{w}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--size-mib", type=float, default=2.0)
    ap.add_argument("--rate-mib", type=float, default=1.0)
    ap.add_argument("--piece-kib", type=int, default=32)
    ap.add_argument("--trees", type=int, default=4)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4, help="processes hosting the N peers")
    ap.add_argument("--designs", nargs="+", default=["tree", "star", "shardcast"],
                    choices=["tree", "star", "shardcast"])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--netns", action="store_true", help="each peer a process in its own network namespace, "
                    "its uplink shaped by the kernel (tbf), not by our code: see bench/broadcast_netns.py (root)")
    ap.add_argument("--tbf-latency-ms", type=int, default=100, help="--netns: tbf queue limit, in ms")
    # internal roles
    ap.add_argument("--peer-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sc-role", choices=["origin", "middle", "clients"], help=argparse.SUPPRESS)
    ap.add_argument("--tracker", help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--bind", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--indices", nargs="+", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--no-relay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_worker:
        asyncio.run(_peer_worker(args))
        return
    if args.sc_role:
        sc_role(args)
        return
    if args.netns:
        from broadcast_netns import bench_netns  # bench/ is on sys.path when run as a script

        results = bench_netns(args)
    else:
        results = asyncio.run(bench(args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

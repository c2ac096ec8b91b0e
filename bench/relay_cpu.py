"""Where a relay's CPU goes, per piece: one version through the relay tree on loopback (bench/broadcast.py's
tree design: an origin in this process, the peers in one worker process, every uplink paced to B), the
worker's event-loop thread under cProfile with that thread's CPU clock (time.thread_time).

    python bench/relay_cpu.py [--n 8] [--size-mib 16] [--rate-mbit 20] [--piece-kib 32 256 1024] [--json FILE]
    python bench/relay_cpu.py --netns ...   (as root: each peer a process on a host of its own, its uplink
                                            shaped by the kernel, as `bench/broadcast.py --netns`; no pacing
                                            in our code, so what is left is what a deployed relay spends)

For each piece size: T / (S/B), the peers' CPU seconds per piece received (all threads: rusage), the part
the profile saw on the event loop's thread (the rest is in worker threads: hashing large pieces, opening
and finishing files), and the functions that took most of it. Issue 28 asked where the CPU goes at
20 Mbit/s with 256 KiB pieces across namespaces, where the 2 cores were the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.broadcast import run_ours  # noqa: E402

MiB = 1 << 20


def where(stats: pstats.Stats, top: int) -> list[tuple[str, float]]:
    """(function, its own CPU seconds on the profiled thread), the largest first."""
    rows = []
    for (path, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where_ = f"{Path(path).parent.name}/{Path(path).name}:{line}({name})" if line else name
        rows.append((where_, tottime))
    return sorted(rows, key=lambda r: -r[1])[:top]


def figures(profiles: list[Path], n: int, size: int, piece: int, t_over_sb: float, peers_cpu_s: float,
            origin_cpu_s: float, top: int) -> dict:
    """Per piece received (every peer receives every piece): the peers' CPU, the profiled thread's, and where."""
    stats = pstats.Stats(*[str(p) for p in profiles])
    pieces = n * -(-size // piece)
    return {"piece_bytes": piece, "T_over_SB": t_over_sb, "pieces_received": pieces, "profiles": len(profiles),
            "peers_cpu_s": peers_cpu_s, "origin_cpu_s": origin_cpu_s,
            "peers_ms_per_piece": 1e3 * peers_cpu_s / pieces,
            "loop_ms_per_piece": 1e3 * stats.total_tt / pieces,  # type: ignore[attr-defined]
            "top": [(f, 1e3 * s / pieces) for f, s in where(stats, top)]}


def one(n: int, size: int, rate: float, piece: int, trees: int, top: int, tmp: Path) -> dict:
    prefix = tmp / f"prof-{piece >> 10}k"
    os.environ["BENCH_PROFILE"] = str(prefix)
    try:
        r = asyncio.run(run_ours("tree", n, size, rate, piece, trees, 1, 2, tmp, 4 * size / rate + 60))
    finally:
        del os.environ["BENCH_PROFILE"]
    if r.get("T") is None:
        return {"piece_bytes": piece, "error": r.get("error")}
    return figures(list(tmp.glob(f"{prefix.name}-*.prof")), n, size, piece, r["T"] / (size / rate),
                   r["peers_cpu_s"], r["origin_cpu_s"], top)


def netns_one(n: int, size_mib: float, rate: float, piece: int, trees: int, top: int, tmp: Path) -> dict:
    """The same across network namespaces: bench/broadcast.py --netns, each peer dumping its profile."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "netns.json"
    env = dict(os.environ, BENCH_PROFILE=str(tmp / "prof"))
    cmd = [sys.executable, str(REPO / "bench" / "broadcast.py"), "--netns", "--n", str(n), "--size-mib", str(size_mib),
           "--rate-mib", str(rate / MiB), "--piece-kib", str(piece >> 10), "--trees", str(trees), "--designs", "tree",
           "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    (row,) = json.loads(out.read_text())["rows"]
    if row.get("T") is None:
        return {"piece_bytes": piece, "error": row.get("error")}
    # Across namespaces the origin is a process of the lab too: its CPU is in cpu_s.
    return figures(list(tmp.glob("prof-*.prof")), n, int(size_mib * MiB), piece, row["ratio"], row["cpu_s"], 0.0, top)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--size-mib", type=float, default=16.0)
    ap.add_argument("--rate-mbit", type=float, default=20.0)
    ap.add_argument("--piece-kib", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--trees", type=int, default=4)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--netns", action="store_true", help="across network namespaces (root; see above)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the profiles here (pstats files, one per process)")
    args = ap.parse_args()
    size, rate = int(args.size_mib * MiB), args.rate_mbit * 1e6 / 8
    print(f"N = {args.n} peers in one process, S = {args.size_mib} MiB, B = {args.rate_mbit} Mbit/s, "
          f"S/B = {size / rate:.1f} s, {args.trees} trees; CPU per piece received, the peers' process")
    rows = []
    with tempfile.TemporaryDirectory(prefix="relaycpu-") as td:
        td = str(args.keep or td)
        for piece in args.piece_kib:
            tmp = Path(td) / f"{piece}k"
            r = (netns_one(args.n, args.size_mib, rate, piece << 10, args.trees, args.top, tmp) if args.netns
                 else one(args.n, size, rate, piece << 10, args.trees, args.top, tmp))
            rows.append(r)
            if "error" in r:
                print(f"\n{piece} KiB pieces: {r['error']}")
                continue
            print(f"\n{piece} KiB pieces: T/(S/B) {r['T_over_SB']:.2f}; {r['pieces_received']} pieces received; "
                  f"peers {r['peers_ms_per_piece']:.2f} ms CPU a piece ({r['loop_ms_per_piece']:.2f} on the event "
                  f"loop's thread, the rest in worker threads); origin {r['origin_cpu_s']:.1f} CPU s in all"
                  + (" (netns: the origin's CPU is in the peers' figure)" if args.netns else ""))
            for f, ms in r["top"]:
                print(f"  {ms:7.3f} ms  {f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

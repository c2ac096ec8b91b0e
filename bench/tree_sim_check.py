"""Check bench/tree_sim's model against the real thing: the same N, S, uplink rate, piece size, trees and
window through bench/broadcast.py's tree design (real peers, real HTTP on loopback, uplinks paced in code)
and through the simulation (every uplink at that rate, downlinks unlimited, 0.1 ms to the core, no churn).
Prints T for both and their ratio."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.broadcast import MiB, run_ours  # noqa: E402
from bench.simlib.links import Link  # noqa: E402
from bench.tree_sim import run_tree  # noqa: E402
from broadcast.config import OriginConfig, PeerConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--size-mib", type=float, default=4.0)
    ap.add_argument("--rate-mib", type=float, default=1.0)
    ap.add_argument("--piece-kib", type=int, default=64)
    ap.add_argument("--trees", type=int, default=OriginConfig().n_trees)
    ap.add_argument("--window", type=int, default=PeerConfig().window)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    size, rate = int(args.size_mib * MiB), args.rate_mib * MiB
    args.fanout, args.piece = args.trees, args.piece_kib << 10
    args.warmup_size, args.warmups = size, 1
    args.no_probes, args.first_version_s = True, 3.0  # the bench's peers are fresh keys: the origin probes none
    print(f"S = {args.size_mib} MiB, B = {args.rate_mib} MiB/s per uplink (origin too), S/B = {size / rate:.2f} s, "
          f"pieces of {args.piece_kib} KiB, {args.trees} trees, window {args.window}")
    print(f"{'N':>3} {'real T (s)':>10} {'sim T (s)':>10} {'sim/real':>9}")
    rows = []
    for n in args.n:
        with tempfile.TemporaryDirectory(prefix="treesimcheck-") as td:
            real = asyncio.run(run_ours("tree", n, size, rate, args.piece, args.trees, args.workers, args.window,
                                        Path(td), 4 * size / rate + 30))
        links = [Link(rate, math.inf, 0.0001) for _ in range(n)]
        sim = run_tree(links, Link(rate, math.inf, 0.0001), size, [], args, measured=False, seed=0)
        ratio = sim["T"] / real["T"] if real.get("T") else None
        rows.append({"N": n, "real_T": real.get("T"), "real_error": real.get("error"), "sim_T": sim["T"],
                     "ratio": ratio, "real_cpu_frac_of_2_cores": real.get("cpu_frac_of_2_cores")})
        rt = f"{real['T']:>10.2f}" if real.get("T") else f"{'failed':>10}"
        print(f"{n:>3} {rt} {sim['T']:>10.2f} {ratio if ratio else float('nan'):>9.2f}"
              f"  real CPU {100 * (real.get('cpu_frac_of_2_cores') or 0):.0f}% of 2 cores", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

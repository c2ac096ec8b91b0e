"""A relay at the top of a tree on a busy machine: how long does its subtree wait? (The simulator, with the
relay tree's real decision code; docs/tree-simulation.md.)

N peers with equal uplinks B and unlimited downlinks, a new swarm (no uplink measured, no probes: the
join-order layout, as bench/broadcast.py's fresh peers get), one version of S. The first peer to join heads
tree 0; from the version's start its uplink is B / --factor (a machine busy with other work). Prints T/(S/B)
and when the slow relay, and the last of the others, held the version.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.simlib.engine import Host, Sim  # noqa: E402
from bench.simlib.swarm import Swarm  # noqa: E402
from broadcast.config import OriginConfig, PeerConfig  # noqa: E402

MiB = 1 << 20


def run(n: int, size: int, piece: int, rate: float, factor: float, stall_timeout: float, slow_n: int = 1,
        versions: int = 1) -> dict:
    """The last version's figures (`versions` > 1: the earlier ones have laid the trees out by what was
    measured); `first_others`: when the first version reached the last of the others."""
    sim = Sim()
    sw = Swarm(sim, Host("origin", rate, float("inf"), 0.0005), OriginConfig(heartbeat_s=1.0),
               PeerConfig(stall_timeout=stall_timeout), piece, probes=False)
    sw.tracker.forest.order_key = b""  # lay out in join order (not the tracker's keyed shuffle): p0 heads tree 0
    peers = [sw.new_peer(i, Host(f"p{i}", rate, float("inf"), 0.0005)) for i in range(n)]
    for i, p in enumerate(peers):
        sim.at(0.01 * i, sw.arrive, p)
    slow = peers[:slow_n]  # the first to join: at the top of the trees
    for p in slow:
        sim.at(2.0, setattr, p.host, "up", rate / factor)
    sw.on_all_done = lambda: setattr(sim, "stopped", True)
    bad, t0, first_others = {p.idx for p in slow}, 2.0, None
    for v in range(1, versions + 1):
        sim.stopped = False
        sim.at(t0, sw.publish, v, size)
        sim.run(until=t0 + 3600.0)
        done = {p.idx: p.done_at.get(v, float("inf")) - t0 for p in peers}
        others = max(t for i, t in done.items() if i not in bad)
        first_others = others if first_others is None else first_others
        t0 = sim.now + 1.0
    return {"T": max(done.values()), "slow_done": max(done[i] for i in bad), "others_done": others,
            "first_others": first_others,
            "bypasses": sum(p.book.bypasses for p in peers), "reports": dict(sw.reports)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--size-mib", type=float, default=16.0)
    ap.add_argument("--piece-kib", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rate-mbit", type=float, default=20.0)
    ap.add_argument("--factor", type=float, nargs="+", default=[1, 5, 20], help="the slow relay's uplink: B / this")
    ap.add_argument("--stall-timeout", type=float, default=60.0, help="the peers' (bench/broadcast.py's: 60)")
    ap.add_argument("--versions", type=int, default=1, help="versions in a row (the last one's figures; the "
                    "first one's others in the note)")
    ap.add_argument("--slow", type=int, default=1, help="how many relays are slow (the first to join; issue 29's "
                    "slow-loris: a third of N)")
    args = ap.parse_args()
    size, rate = int(args.size_mib * MiB), args.rate_mbit * 1e6 / 8
    print(f"N = {args.n}, S = {args.size_mib} MiB, B = {args.rate_mbit} Mbit/s, S/B = {size / rate:.1f} s; "
          f"the first {args.slow} relays' uplink B / factor from the version's start")
    print(f"{'piece':>6} {'factor':>6} {'T/(S/B)':>8} {'slow relay done (s)':>20} {'others done (s)':>16} {'others/(S/B)':>7}  note")
    for piece in args.piece_kib:
        for f in args.factor:
            r = run(args.n, size, piece << 10, rate, f, args.stall_timeout, args.slow, args.versions)
            print(f"{piece:>4}Ki {f:>6g} {r['T'] / (size / rate):>8.2f} {r['slow_done']:>20.1f} "
                  f"{r['others_done']:>16.1f} {r['others_done'] / (size / rate):>7.2f}  v1 others {r['first_others']:.1f} s, bypasses {r['bypasses']}, reports {r['reports']}", flush=True)


if __name__ == "__main__":
    main()

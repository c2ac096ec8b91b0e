"""Issue 29's attacks on the relay tree, simulated with the tree's real decision code (bench/simlib drives
broadcast/'s tracker, verdicts and piece races on simulated time; docs/tree-simulation.md).

N peers with equal uplinks B, a new swarm (no probes: the join-order layout), `--versions` versions of S in
a row. The honest peers are the simulator's usual ones (keys the trainer trusts; with `--strangers`, fresh
keys as well, as in a public swarm of strangers); the first K peers to join
(a third by default) are attackers with fresh keys that pass the origin's checks (the simulated check reads
whether the relay holds the piece, not how it serves others: the attackers can tell the origin apart, as a
leaf always can) and then:
  liars    send their children nothing (uplink ~0) and report every honest relay stalling, each second
  friends  send their children nothing, and say in every heartbeat they received each other's pieces at
           12.5 GB/s (what placement reads)
  loris    send everyone 32 KiB/s (their uplink), as bench/slow_relay.py --slow
  sinkers  send their children nothing, and say in every heartbeat that each of their parents answered and
           sent them nothing (what placement reads; not in the default set, which stays comparable)
`--leaves F`: that share of the honest peers (arrivals too) can't relay, as nodes behind a NAT can't (download-
only leaves; drawn per seed).
`--churn C`: during each version C*N/2 honest peers leave (half post /leave, half die) and C*N/2 new
honest ones arrive, at uniform times in the version's first CHURN_SPAN_S seconds (as bench/tree_sim.py).
Prints, per attack and for the same swarm unattacked (all K honest), when each version reached the last
honest peer present, the ratio, and the honest relays ever demoted.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.simlib.engine import Host, Sim  # noqa: E402
from bench.simlib.swarm import Swarm  # noqa: E402
from broadcast.config import OriginConfig, PeerConfig  # noqa: E402
from broadcast.messages import PeerHeartbeat, Received, Report  # noqa: E402

MiB = 1 << 20
ATTACKS = ("liars", "friends", "loris", "sinkers")
DEFAULT_ATTACKS = ATTACKS[:3]
CHURN_SPAN_S = 4.0  # about half an unattacked version at the defaults


def run(n: int, k: int, size: int, piece: int, rate: float, attack: str | None, versions: int,
        churn: float = 0.0, seed: int = 0, strangers: bool = False, leaves: float = 0.0) -> dict:
    """One swarm's versions. `seed`: the churn's draws, the tracker's peer ids and its order among equals
    (seed 0 is the run this bench made before it took seeds); `strangers`: the honest keys are not trusted
    either, and earn standing as any key does; `leaves`: the share of honest peers that can't relay."""
    sim = Sim()
    sw = Swarm(sim, Host("origin", rate, float("inf"), 0.0005), OriginConfig(heartbeat_s=1.0),
               PeerConfig(stall_timeout=60.0), piece, probes=False, seed=f" {seed}" if seed else "",
               trusted=not strangers)
    nat = random.Random(f"leaves {seed}")

    def new_peer(i: int, honest: bool = True):
        p = sw.new_peer(i, Host(f"p{i}", rate, float("inf"), 0.0005))
        p.relay = nat.random() >= leaves or not honest  # (drawn for each: the same leaves with or without attack)
        return p

    peers = [new_peer(i, i >= k or not attack) for i in range(n)]
    for i, p in enumerate(peers):
        sim.at(0.5 * i / n, sw.arrive, p)  # join order: the attackers first (all joined before 0.9 s)
    bad = peers[:k] if attack else []
    honest = [p for p in peers if p not in bad]
    t = sw.origin.tracker
    ever_demoted: set[str] = set()

    def untrust() -> None:  # the simulator trusts its peers (established nodes); attackers are fresh keys
        for a in bad:
            t.set_trusted(t.peers[a.pid].key, False)

    def tick() -> None:
        ever_demoted.update(p.pid for p in honest if p.pid in t.peers and t.peers[p.pid].demoted)
        for a in bad:
            if not a.pid or a.pid not in t.peers:
                continue
            if attack == "liars":
                for h in honest:
                    msg = Report(a.pid, a.token, h.url, "stall", max(sw.latest, 1), 0, "no bytes")
                    sw.origin.report(a.pid, msg, lambda _: None)
            elif attack == "sinkers":
                parents = [chain[0] for chain in t.sources(a.pid) if chain]
                sw.origin.heartbeat(PeerHeartbeat(a.pid, a.token, list(a.complete),
                                                  recent={u: Received(0, 5.0) for u in parents}), sw.latest)
            elif attack == "friends":
                others = [b.url for b in bad if b is not a]
                sw.origin.heartbeat(PeerHeartbeat(a.pid, a.token, list(a.complete), received={u: 1 << 34 for u in others},
                                                  recent={u: Received(25_000 * MiB, 2.0) for u in others}), sw.latest)
        sim.after(1.0, tick)

    up = 32 << 10 if attack == "loris" else 1.0
    for a in bad:
        sim.at(2.0, setattr, a.host, "up", up)
    sim.at(0.9, untrust)
    sim.at(1.0, tick)
    sw.on_all_done = lambda: setattr(sim, "stopped", True)
    t0, took = 2.0, []
    rng, moves = random.Random(7 + seed), int(churn * n / 2)
    for v in range(1, versions + 1):
        sim.stopped = False
        sim.at(t0, sw.publish, v, size)
        for j, p in enumerate(rng.sample([p for p in honest if p.host.alive], moves)):
            sim.at(t0 + rng.uniform(0, CHURN_SPAN_S), sw.depart, p, j % 2 == 0)
        for _ in range(moves):
            p = new_peer(len(peers))
            peers.append(p)
            honest.append(p)
            sim.at(t0 + rng.uniform(0, CHURN_SPAN_S), sw.arrive, p)
        sim.run(until=t0 + 3600.0)
        took.append(max(p.done_at.get(v, float("inf")) for p in honest if p.host.alive) - t0)
        t0 = sim.now + 1.0
    return {"took": took, "demoted": len(ever_demoted), "reports": dict(sw.reports)}


def _one(job: tuple) -> tuple[str, int, dict]:
    attack, seed, args = job
    k = args.attackers or args.n // 3
    r = run(args.n, k, int(args.size_mib * MiB), args.piece_kib << 10, args.rate_mbit * 1e6 / 8,
            None if attack == "none" else attack, args.versions, args.churn, seed, args.strangers, args.leaves)
    return attack, seed, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--attackers", type=int, default=0, help="K (default: N / 3)")
    ap.add_argument("--size-mib", type=float, default=16.0)
    ap.add_argument("--piece-kib", type=int, default=256)
    ap.add_argument("--rate-mbit", type=float, default=20.0)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--attack", nargs="+", default=list(DEFAULT_ATTACKS), choices=ATTACKS)
    ap.add_argument("--churn", type=float, default=0.0, help="share of N that leaves and arrives each version")
    ap.add_argument("--seed", type=int, nargs="+", default=[0],
                    help="one swarm per seed (churn, peer ids, order among equals); with several, a summary. "
                         "Runs repeat exactly: one seed is one draw, not the design")
    ap.add_argument("--strangers", action="store_true",
                    help="honest peers join as strangers too (no key the trainer trusts), as in a public swarm")
    ap.add_argument("--leaves", type=float, default=0.0,
                    help="share of the honest peers that can't relay (behind a NAT: download-only leaves)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, in worker processes")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    k = args.attackers or args.n // 3
    size, rate = int(args.size_mib * MiB), args.rate_mbit * 1e6 / 8
    print(f"N = {args.n}, K = {k} attackers (the first to join), S = {args.size_mib} MiB, B = {args.rate_mbit} "
          f"Mbit/s, S/B = {size / rate:.1f} s, {args.versions} versions, churn {args.churn:.0%}"
          f"{', honest peers strangers too' if args.strangers else ''}"
          f"{f', {args.leaves:.0%} of them leaves' if args.leaves else ''}; seconds until "
          "the last honest peer present held each version", flush=True)
    jobs = [(a, seed, args) for seed in args.seed for a in ["none", *args.attack]]
    results = {}
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for a, seed, r in pool.map(_one, jobs):  # (in order; each as it is done, on stderr: runs take minutes)
            results[a, seed] = r
            print(f"  [{len(results)}/{len(jobs)}] seed {seed} {a}: {[round(x, 1) for x in r['took']]} s",
                  file=sys.stderr, flush=True)
    print(f"{'seed':<5} {'attack':<10} {'per version (s)':<28} {'x unattacked':<24} honest demoted")
    ratios: dict[str, list[list[float]]] = {a: [] for a in args.attack}
    for seed in args.seed:
        base = results["none", seed]
        print(f"{seed:<5} {'none':<10} {str([round(x, 1) for x in base['took']]):<28} {'':<24} {base['demoted']}")
        for attack in args.attack:
            r = results[attack, seed]
            ratio = [round(a / b, 2) for a, b in zip(r["took"], base["took"], strict=True)]
            ratios[attack].append(ratio)
            print(f"{seed:<5} {attack:<10} {str([round(x, 1) for x in r['took']]):<28} {str(ratio):<24} "
                  f"{r['demoted']}  reports {r['reports']}")
    if len(args.seed) > 1:
        print(f"over seeds {', '.join(map(str, args.seed))}: per version, mean (max) x unattacked")
        for attack, rs in ratios.items():
            cols = [f"{statistics.mean(v):.2f} ({max(v):.2f})" for v in zip(*rs, strict=True)]
            print(f"  {attack:<10} {'  '.join(cols)}")
    if args.json:
        args.json.write_text(json.dumps([{"attack": a, "seed": seed, **r} for (a, seed), r in results.items()],
                                        indent=1))


if __name__ == "__main__":
    main()

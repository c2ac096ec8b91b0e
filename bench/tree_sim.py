"""Simulate one version reaching N peers at internet scale, through the real tracker, and compare T with
the fluid bound max(S/u_origin, S/d_min, N*S/(u_origin + sum of uplinks)) and with a star and SHARDCAST.

  tree        broadcast.tracker.Tracker places peers; peers behave as broadcast/peer.py (bench/simlib)
  tree-blind  the same, but peers send no upload reports, so placement falls back to join order
  star        every peer fetches from the origin (fluid model, its best case)
  shardcast   origin -> ceil(sqrt(N)) relays with server links -> peers (fluid model, its best case)

Each tree run first sends --warmups versions (delta-sized, no churn): the tree has carried versions before,
and the tracker has measured uplinks. The peers join in the first second and the first warm-up leaves at
--first-version-s; it is laid out by the origin's probes of uplinks done by then (broadcast/uplink_probe.py;
--no-probes: the join-order layout). Then the
measured version with churn: churn*N/2 peers leave (half post /leave, half die) and churn*N/2 arrive at
uniform times in [0, B/2] after publishing (B = the bound of the starting swarm). T runs from publishing
until every peer present at the end holds the version. The bound adds max(a + S/d) over arrivals.
See docs/tree-simulation.md for the model.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.simlib.engine import Host, Sim  # noqa: E402
from bench.simlib.fluid import shardcast, star  # noqa: E402
from bench.simlib.links import DISTRIBUTIONS, Link, Mbit, draw, fluid_bound  # noqa: E402
from bench.simlib.swarm import Swarm  # noqa: E402
from broadcast.config import OriginConfig, PeerConfig  # noqa: E402
from broadcast.delta_publish import delta_piece_size  # noqa: E402

ORIGIN, PEER = OriginConfig(), PeerConfig()  # the defaults: the tree's own
MB = 1e6


def plan_churn(rng: random.Random, n: int, churn: float, window: float, dist: str) -> list[tuple]:
    """(time after publish, 'leave'|'die'|'arrive', Link or None), sorted."""
    k = round(churn * n)
    ev = []
    for j in range(k):
        kind = "arrive" if j % 2 else ("leave" if j % 4 == 0 else "die")
        ev.append((rng.uniform(0, window), kind, draw(dist, rng) if kind == "arrive" else None))
    return sorted(ev, key=lambda e: e[0])


def run_tree(links: list[Link], origin: Link, size: int, churn: list[tuple], args, measured: bool,
             seed: int) -> dict:
    sim = Sim()
    o = Host("origin", origin.up, origin.down, origin.lat)
    rng = random.Random(seed + 7)
    origin_cfg = OriginConfig(fanout=args.fanout, trees=args.trees)
    make = getattr(args, "swarm_cls", Swarm)  # bench/tree_trace.py passes one that records each piece
    sw = make(sim, o, origin_cfg, PeerConfig(window=args.window), args.piece, report_uploads=measured,
               probes=not args.no_probes)
    peers = [sw.new_peer(i, Host(f"p{i}", lk.up, lk.down, lk.lat)) for i, lk in enumerate(links)]
    for p in peers:
        sim.at(rng.uniform(0, 1.0), sw.arrive, p)
    sw.on_all_done = lambda: setattr(sim, "stopped", True)
    warm_T, t_pub = [], args.first_version_s
    probed: list[int] = []  # relays the origin had timed when the first version left
    sim.at(t_pub, lambda: probed.append(len(sw.tracker.uploads.probed)))
    for v in range(1, args.warmups + 1):
        sim.stopped = False
        sim.at(t_pub, sw.publish, v, args.warmup_size)
        sim.run(until=t_pub + 1e6)
        warm_T.append(round(max(p.done_at[v] for p in peers if p.host.alive) - t_pub, 1))
        t_pub = sim.now + 1.0
    sim.stopped = False
    last = args.warmups + 1
    state = {"left": len(churn)}
    arrivals: list[tuple[float, Link]] = []

    def done_check() -> None:
        if state["left"] == 0 and all(last in p.done_at for p in sw.peers.values() if p.host.alive):
            sim.stopped = True

    def churn_event(kind: str, lk: Link | None) -> None:
        if kind == "arrive":
            p = sw.new_peer(len(sw.peers), Host(f"p{len(sw.peers)}", lk.up, lk.down, lk.lat))
            arrivals.append((sim.now - t_pub, lk))
            sw.arrive(p)
        else:
            alive = [p for p in sw.peers.values() if p.host.alive and p.pid]
            sw.depart(rng.choice(alive), graceful=kind == "leave")
        state["left"] -= 1
        done_check()

    sw.on_all_done = done_check
    warm_reports, sw.reports = dict(sw.reports), collections.Counter()
    sim.at(t_pub, sw.publish, last, size)
    for dt, kind, lk in churn:
        sim.at(t_pub + dt, churn_event, kind, lk)
    sim.run(until=t_pub + 1e6)
    present = [p for p in sw.peers.values() if p.host.alive]
    missing = sum(last not in p.done_at for p in present)
    T = max(p.done_at.get(last, math.inf) for p in present) - t_pub
    bound = fluid_bound(size, origin.up, [Link(p.host.up, p.host.down, 0) for p in present], arrivals)
    return {"T": T, "bound": bound, "warmup_T": warm_T, "probed_at_first": probed[0], "present": len(present),
            "missing": missing, "events": sim.events, "reports": dict(sw.reports), "warmup_reports": warm_reports,
            "tracker_peers": len(sw.tracker.peers), "gave_up": sw.fetch.gave_up}


def run_fluid(design: str, links: list[Link], origin: Link, size: int, churn: list[tuple], rng) -> dict:
    clients = [(0.0, math.inf, lk.down) for lk in links]
    arrivals = []
    for dt, kind, lk in churn:
        if kind == "arrive":
            clients.append((dt, math.inf, lk.down))
            arrivals.append((dt, lk))
        else:
            i = rng.choice([i for i, c in enumerate(clients) if c[1] == math.inf and c[0] <= dt])
            clients[i] = (clients[i][0], dt, clients[i][2])
    extra = {}
    if design == "star":
        fin = star(size, origin.up, clients)
    else:
        fin, m = shardcast(size, origin.up, origin.up, origin.down, clients)
        extra["relays"] = m
    present = [i for i, c in enumerate(clients) if c[1] == math.inf]
    all_links = links + [lk for _, lk in arrivals]
    bound = fluid_bound(size, origin.up, [all_links[i] for i in present], arrivals)
    return {"T": max(fin[i] for i in present), "bound": bound, "present": len(present), **extra}


def run_seed(args, seed: int, out: dict) -> None:
    """One draw of links and churn: every version and design, printed and added to out['rows']."""
    rng = random.Random(seed)
    links = [draw(args.dist, rng) for _ in range(args.n)]
    origin = Link(args.origin_mbit * Mbit, args.origin_mbit * Mbit, 0.002)
    print(f"N = {args.n}, links: {args.dist} = {DISTRIBUTIONS[args.dist]}; seed {seed}")
    print(f"origin {args.origin_mbit:.0f} Mbit/s; {args.trees} trees, fanout {args.fanout}, window {args.window}; "
          f"churn {args.churn:.0%} of N during the version; mean uplink "
          f"{sum(lk.up for lk in links) / len(links) / Mbit:.1f} Mbit/s, min downlink "
          f"{min(lk.down for lk in links) / Mbit:.1f} Mbit/s")
    print(f"{'version':<7} {'S (MB)':>7} {'piece':>6} {'design':<11} {'T (s)':>8} {'bound (s)':>9} {'T/bound':>8}  note")
    for kind in args.versions:
        size = int(args.size_mb * MB * (args.delta_frac if kind == "delta" else 1.0))
        if kind == "delta":  # the origin's own rule for a delta's pieces, unless given
            args.piece = (args.delta_piece_kib << 10 if args.delta_piece_kib
                          else delta_piece_size(size, args.piece_kib << 10))
        else:
            args.piece = (args.piece_kib << 10) * args.batch
        args.warmup_size = int(args.size_mb * MB * (args.warmup_frac or args.delta_frac))
        b0 = fluid_bound(size, origin.up, links)
        churn = plan_churn(random.Random(seed + 1), args.n, args.churn, b0 / 2, args.dist)
        for design in args.designs:
            t0 = time.process_time()
            if design.startswith("tree"):
                r = run_tree(links, origin, size, churn, args, measured=design == "tree", seed=seed)
                note = (f"warm-ups {r['warmup_T']} s ({r['probed_at_first']} probed by the first); "
                        f"{r['present']} present; reports {r['reports']} "
                        f"(warm-ups {r['warmup_reports']}); "
                        f"{r['events'] / 1e6:.2f}M events")
                if r["missing"]:
                    note += f"; {r['missing']} never finished"
            else:
                r = run_fluid(design, links, origin, size, churn, random.Random(seed + 2))
                note = f"fluid; {r['present']} present" + (f"; {r['relays']} relays" if "relays" in r else "")
            r.update(seed=seed, version=kind, size=size, piece=args.piece, design=design, ratio=r["T"] / r["bound"],
                     cpu_s=time.process_time() - t0)
            out["rows"].append(r)
            print(f"{kind:<7} {size / MB:>7.1f} {args.piece >> 10:>4}Ki {design:<11} {r['T']:>8.2f} {r['bound']:>9.2f} "
                  f"{r['ratio']:>8.2f}  {note}; {r['cpu_s']:.0f} s CPU", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--dist", default="home-mix", choices=sorted(DISTRIBUTIONS))
    ap.add_argument("--seed", type=int, nargs="+", default=[1],
                    help="one run per seed, each drawing links and churn anew; with several, a summary")
    ap.add_argument("--size-mb", type=float, default=270.0, help="full version (SmolLM2-135M in bf16)")
    ap.add_argument("--delta-frac", type=float, default=0.05)
    ap.add_argument("--versions", nargs="+", default=["full", "delta"], choices=["full", "delta"])
    ap.add_argument("--designs", nargs="+", default=["tree", "tree-blind", "star", "shardcast"],
                    choices=["tree", "tree-blind", "star", "shardcast"])
    ap.add_argument("--piece-kib", type=int, default=ORIGIN.piece_bytes >> 10, help="the tree's piece_bytes")
    ap.add_argument("--delta-piece-kib", type=int, default=None,
                    help="piece size for deltas (default: the origin's rule, broadcast.delta_publish)")
    ap.add_argument("--warmup-frac", type=float, default=None,
                    help="size of the warm-up version as a share of S (default: the delta's)")
    ap.add_argument("--warmups", type=int, default=3, help="versions sent before the measured one")
    ap.add_argument("--batch", type=int, default=1,
                    help="simulate this many consecutive pieces as one (fewer events; each hop then waits for "
                         "a whole batch, so T comes out pessimistic)")
    ap.add_argument("--trees", type=int, default=ORIGIN.n_trees)
    ap.add_argument("--fanout", type=int, default=ORIGIN.fanout)
    ap.add_argument("--window", type=int, default=PEER.window)
    ap.add_argument("--churn", type=float, default=0.10)
    ap.add_argument("--first-version-s", type=float, default=3.0,
                    help="when the first warm-up is published; the peers join in the first second (the time the "
                         "origin has to probe their uplinks before any version)")
    ap.add_argument("--no-probes", action="store_true",
                    help="the origin does not time relays' uplinks (broadcast/uplink_probe.py; before "
                         "2026-12-05): the first version runs on the join-order layout")
    ap.add_argument("--origin-mbit", type=float, default=1000.0)
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main() -> None:
    args = parser().parse_args()

    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "distribution": DISTRIBUTIONS[args.dist], "rows": []}
    for seed in args.seed:
        run_seed(args, seed, out)
    if len(args.seed) > 1:  # each seed draws links and churn anew: one seed is one draw, not the design
        print(f"over seeds {', '.join(map(str, args.seed))}: T/bound")
        for kind in args.versions:
            for design in args.designs:
                rs = [r["ratio"] for r in out["rows"] if r["version"] == kind and r["design"] == design]
                print(f"{kind:<7} {design:<11} mean {sum(rs) / len(rs):.2f}  min {min(rs):.2f}  max {max(rs):.2f}  "
                      f"({', '.join(f'{x:.2f}' for x in rs)})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

"""Why do the last peers finish late? One bench/tree_sim.py run (same options, one seed), with every try,
failure and piece arrival recorded; for the first version of the new swarm and the measured one it prints
when peers finished, where requests went, how tries failed, and for the latest peers the path their last
piece took from the origin (when each hop asked for it and held it, and each hop's uplink).

  python bench/tree_trace.py --versions delta --seed 1 --late 5
"""

from __future__ import annotations

import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import tree_sim  # noqa: E402
from bench.simlib.fetch import Fetching  # noqa: E402
from bench.simlib.swarm import Swarm  # noqa: E402
from broadcast.messages import ORIGIN  # noqa: E402

Mbit = 1e6 / 8


class TracingFetching(Fetching):
    def __init__(self, sw, log: dict):
        super().__init__(sw)
        self.log = log

    def _ask(self, p, rs, tr) -> None:  # (t, peer, version, piece, source, position in the chain, failures)
        self.log["tries"].append((self.sw.sim.now, p.idx, rs.version, rs.index, tr.src, rs.race.pos, rs.failures))
        super()._ask(p, rs, tr)

    def _conclude(self, req, how: str, detail: str) -> None:
        if req.tr in req.rs.reqs and self._current(req.peer, req.rs):
            self.log["failed"][(req.rs.version, how, req.tr.answered)] += 1
        super()._conclude(req, how, detail)

    def _arrived(self, req, size: int) -> None:
        if req.tr in req.rs.reqs and self._current(req.peer, req.rs):
            self.log["pieces"][(req.rs.version, req.peer.idx, req.index)] = (self.sw.sim.now, req.tr.src, req.tr.started)
        super()._arrived(req, size)


class TracingSwarm(Swarm):
    runs: list[TracingSwarm] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = {"tries": [], "failed": collections.Counter(), "pieces": {}, "left": {}}
        self.fetch = TracingFetching(self, self.log)
        self.published: dict[int, float] = {}
        TracingSwarm.runs.append(self)

    def publish(self, v: int, size: int) -> None:
        self.published[v] = self.sim.now
        super().publish(v, size)

    def depart(self, p, graceful: bool) -> None:
        self.log["left"][p.idx] = (self.sim.now, "left" if graceful else "died")
        super().depart(p, graceful)


def report(sw: TracingSwarm, v: int, late: int) -> None:
    t0, log = sw.published[v], sw.log
    by_idx = {p.idx: p for p in sw.peers.values()}
    done = sorted((p.done_at[v] - t0, p.idx) for p in sw.peers.values() if p.host.alive and v in p.done_at)
    q = [done[min(len(done) - 1, int(f * len(done)))][0] for f in (0.1, 0.5, 0.9, 0.99)]
    print(f"\nversion {v}: {len(done)} peers done; after publishing p10 {q[0]:.2f} s, p50 {q[1]:.2f}, p90 {q[2]:.2f}, "
          f"p99 {q[3]:.2f}, last {done[-1][0]:.2f}")
    tries = [t for t in log["tries"] if t[2] == v]
    where = collections.Counter("origin" if t[4] == ORIGIN else "parent" if t[5] == 1 else "an ancestor (bypass)"
                                for t in tries)
    print(f"  {len(tries)} tries: {dict(where)}; {sum(t[6] > 0 for t in tries)} after a failed race")
    failed = {f"{how}{' after the answer' if answered else ''}": n for (vv, how, answered), n in log["failed"].items()
              if vv == v}
    print(f"  tries that failed: {failed or 'none'}")

    def idx(url: str) -> int | None:
        return None if url == ORIGIN else sw.peers[url].idx

    def name(url: str) -> str:
        return "origin" if url == ORIGIN else f"p{idx(url)}"

    for finish, i in done[-late:]:
        last = max((k[2] for k in log["pieces"] if k[0] == v and k[1] == i), key=lambda j: log["pieces"][(v, i, j)][0])
        print(f"  p{i} done at {finish:.2f} s; its last piece {last}, hop by hop from the receiver up:")
        hop: int | None = i
        while hop is not None:
            at, src, _ = log["pieces"].get((v, hop, last), (float("nan"), ORIGIN, float("nan")))
            asks = [f"{t[0] - t0:.2f} {name(t[4])}"
                    + (f" (failures {t[6]})" if t[6] else "") for t in tries if t[1] == hop and t[3] == last]
            gone = log["left"].get(hop)
            print(f"    p{hop}: up {by_idx[hop].host.up / Mbit:.0f} Mbit/s, held it at {at - t0:.2f} s, asked "
                  f"{'; '.join(asks)}" + (f"; {gone[1]} at {gone[0] - t0:.2f} s" if gone else ""))
            hop = idx(src)


def by_depth(sw: TracingSwarm, v: int) -> None:
    """Per tree and depth (1: the origin's children), when that tree's pieces reached the peers there: the
    first and the last piece on average (the latest peer's last), and a piece's mean time from ask to hold. A
    peer's depth in a tree: hops from the origin along the sources its first piece of that tree came from."""
    t0, pieces, k, n = sw.published[v], sw.log["pieces"], sw.trees, sw.n_pieces(v)
    idx_of = {url: p.idx for url, p in sw.peers.items()}
    print(f"  by depth (times after publishing v{v}):")
    for t in range(min(k, n)):
        up = {i: idx_of.get(src) for (vv, i, j), (_, src, _) in pieces.items() if vv == v and j == t}

        def depth(i: int | None, up: dict = up) -> int:
            d = 0
            while i is not None and d < 64:
                d, i = d + 1, up.get(i)
            return d

        rows = collections.defaultdict(list)
        for p in sw.peers.values():
            got = [pieces.get((v, p.idx, i)) for i in range(t, n, k)]
            if all(got):
                rows[depth(p.idx)].append((min(g[0] for g in got) - t0, max(g[0] for g in got) - t0,
                                           statistics.mean(g[0] - g[2] for g in got)))
        for d, r in sorted(rows.items()):
            print(f"    tree {t} depth {d}: {len(r):>4} peers, first piece {statistics.mean(x[0] for x in r):.2f} s, "
                  f"last {statistics.mean(x[1] for x in r):.2f} s (latest {max(x[1] for x in r):.2f}), ask to hold "
                  f"{statistics.mean(x[2] for x in r):.3f} s")


def main() -> None:
    ap = tree_sim.parser()
    ap.description = __doc__
    ap.add_argument("--late", type=int, default=5, help="trace this many of the last peers to finish")
    ap.add_argument("--depths", action="store_true", help="for the measured version, when each tree's pieces "
                    "reached each depth")
    args = ap.parse_args()
    args.designs, args.swarm_cls = ["tree"], TracingSwarm
    for kind in args.versions:
        args.versions = [kind]
        tree_sim.run_seed(args, args.seed[0], {"rows": []})
        sw = TracingSwarm.runs[-1]
        for v in (min(sw.published), max(sw.published)):
            report(sw, v, args.late)
        if args.depths:
            by_depth(sw, max(sw.published))


if __name__ == "__main__":
    main()

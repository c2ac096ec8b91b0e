"""The paired reward test while the policy improves: honest newcomers banned, cherry-pickers let through.

    python bench/probation_sim.py [--seeds 300] [--slope 1] [--json FILE]

Drives the trainer's own hand-out (trainer/work.py), paired test (trainer/pairing.py) and verdicts
(trainer/guard.py) through a run whose policy improves steadily, with one established node answering from
the start and newcomers joining at staggered versions. Only the nodes are simulated: a prompt's chance of
a right answer at version v is sigmoid(a + b + slope * v / 100) (a: the prompt's difficulty, ~N(0, 1.5)),
a sample's reward is 1 or 0 with that chance (binary rewards: the lumpiest case for a z-test), and each
node samples with the announced version or the one before (what `train.work_lag` = 1 allows).
slope 1 climbs from 0.45 to 0.88 mean accuracy over about 300 versions, as the demo's run does
(issue 27: step 388, held-out 0.88); slope 3 learns three times as fast.

Per seed and kind, a newcomer joins at each of versions 20, 60, ..., 380 (divided by the slope: the joins
meet the same accuracies, 0.48 to 0.94, at every slope, while the policy moves `slope` times as much per
version) and stays until its verdict (released, or caught as cherry-picking) or 150 versions. Kinds, each in a run of its own: honest (G
samples), best-of-2 and best-of-4 (they sample 2G or 4G and return the best G: honest log-probs, better
rewards). A cheater's
groups stay in quarantine until its verdict, so "caught before any group trains" means never released.

Rows: the rule as it is, and "old rule" (the rule before issue 27, replayed here: no version window, the
oldest shared prompt first, any partner, a t-statistic over 12 shared prompts, z > 4), which bans honest
newcomers that join a run that has learned.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rewards.base import TaskItem  # noqa: E402
from swarm_common import protocol as P  # noqa: E402
from trainer.guard import Guard, GuardConfig  # noqa: E402
from trainer.work import Shared, WorkHandout  # noqa: E402

G = 8
JOIN_AT = tuple(range(20, 400, 40))  # one newcomer joins at each (divided by the slope)
PATIENCE = 150  # versions a newcomer may stay undecided
E_PER_VERSION = 14  # groups the established node answers per version
N_PER_VERSION = 2  # groups a newcomer answers per version (a new key holds guard.new_key_held = 2)
KINDS = {"honest": 1, "best_of_2": 2, "best_of_4": 4}


class OldHandout(WorkHandout):
    """The hand-out before issue 27, for the baseline row: the oldest shared prompt first, none dropped."""

    def _next_item(self, node_id: str, on_probation: bool) -> TaskItem:
        mine = self.is_reference(node_id)
        for i, d in enumerate(self.dups):
            if d.first != node_id and (mine or self.is_reference(d.first)):
                del self.dups[i]
                return d.item
        item = next(self.items)
        if on_probation or self.rng.random() < self.duplicate_share:
            self.dups.append(Shared(item, node_id, self.version))
            while len(self.dups) > 4 * max(64, self.probation_groups):
                self.dups.popleft()
        return item


class OldPairedRewards:
    """The paired test before issue 27, for the baseline row: mean rewards compared at any versions and
    with any other node, z from the spread of the differences (a t-statistic)."""

    def __init__(self):
        self.by_item: dict[str, dict[str, float]] = defaultdict(dict)
        self.n, self.s, self.ss = Counter(), Counter(), Counter()
        self.compared = self.n

    def add(self, item_id: str, node_id: str, version: int, rewards: list[float]) -> None:
        mean = sum(rewards) / len(rewards)
        for other, r in self.by_item[item_id].items():
            if other != node_id:
                for a, d in ((node_id, mean - r), (other, r - mean)):
                    self.n[a] += 1
                    self.s[a] += d
                    self.ss[a] += d * d
        self.by_item[item_id][node_id] = mean

    def forget_before(self, version: int) -> None:
        pass

    def z(self, node_id: str) -> tuple[int, float]:
        n = self.n[node_id]
        if n < 2:
            return n, 0.0
        mean = self.s[node_id] / n
        var = max((self.ss[node_id] - n * mean * mean) / (n - 1), 1e-4)
        return n, mean / math.sqrt(var / n)


def items(rng: random.Random):
    i = 0
    while True:
        yield TaskItem(id=f"p{i}", prompt="", answer="", meta={"a": repr(rng.gauss(0.0, 1.5))})
        i += 1


def p_right(item: TaskItem, version: int, slope: float) -> float:
    return 1.0 / (1.0 + math.exp(-(float(item.meta["a"]) - 0.3 + slope * version / 100.0)))


def group(rng: random.Random, p: float, k: int) -> list[float]:
    """The G rewards a node returns: the best G of k*G samples (k = 1: honest)."""
    draws = sorted((1.0 if rng.random() < p else 0.0 for _ in range(k * G)), reverse=True)
    return draws[:G] if k > 1 else draws


def simulate(seed: int, kind: str, slope: float, window: int, old_rule: bool = False) -> Counter:
    rng = random.Random(seed)
    # The old rule had its own thresholds too: 12 shared prompts, z > 4.
    cfg = GuardConfig(pair_window=window, pair_min=12, pair_z=4.0) if old_rule else GuardConfig(pair_window=window)
    with tempfile.TemporaryDirectory() as run_dir:
        guard = Guard(run_dir, cfg)
    guard.established.add("E")
    if old_rule:
        guard.pairs = OldPairedRewards()
    handout_cls = OldHandout if old_rule else WorkHandout
    work = handout_cls(items(random.Random(seed + 1)), lambda text: [1], P.SamplingSpec(n=G, max_tokens=1, temperature=1.0, top_p=1.0),
                       inflight_groups=10**6, max_lag=2, work_lag=1, max_held=10**6,
                       duplicate_share=cfg.duplicate_share, probation_groups=cfg.probation_groups,
                       assignment_timeout_s=1e9, seed=seed, pair_window=window,
                       is_reference=guard.is_reference)
    weights = P.WeightsInfo(version=0, manifest_url="")
    out: Counter = Counter()
    newcomers: dict[str, tuple[str, int]] = {}  # id -> (kind, joined at)
    join_at = {round(v / slope) for v in JOIN_AT}
    for v in range(max(join_at) + PATIENCE + 1):
        work.start_at(v)
        if v in join_at:
            newcomers[f"{kind}-{v}"] = (kind, v)
        nodes = [("E", E_PER_VERSION, 1)] + [(n, N_PER_VERSION, KINDS[k]) for n, (k, _) in newcomers.items()]
        rng.shuffle(nodes)
        for node_id, count, k in nodes:
            loaded = v - rng.randint(0, 1)
            req = P.WorkRequest(node_id=node_id, version_loaded=loaded, max_prompts=count)
            for a in work.assign(req, count, node_id != "E", weights).assignments:
                held = work.answered(a.assignment_id, node_id)
                rewards = group(rng, p_right(held.item, loaded, slope), k)
                guard.pairs.add(held.item.id, node_id, loaded, rewards)
        guard.pairs.forget_before(v - 2 - window)
        for node_id, (kind, joined) in list(newcomers.items()):
            verdict = guard.probation_verdict(node_id, 0, has_partner=True)
            if verdict is None and v - joined < PATIENCE:
                continue
            out[f"{kind}:{verdict or 'undecided'}"] += 1
            out[f"{kind}:{verdict or 'undecided'}@{joined}"] += 1
            out[f"{kind}:shared"] += guard.pairs.n[node_id]
            if verdict == "released":
                out[f"{kind}:versions_to_release"] += v - joined
            del newcomers[node_id]
    return out


def row(name: str, seeds: list[int], slope: float, window: int, old_rule: bool = False) -> dict:
    t0 = time.perf_counter()
    total: Counter = Counter()
    for s in seeds:
        for kind in KINDS:
            total += simulate(s, kind, slope, window, old_rule)
    r: dict = {"rule": name, "slope": slope, "window": window, "seeds": len(seeds),
               "seconds": round(time.perf_counter() - t0, 1)}
    for kind in KINDS:
        n = sum(total[f"{kind}:{v}"] for v in ("released", "cherry_picking", "undecided"))
        r[kind] = {"probations": n, "released": total[f"{kind}:released"],
                   "banned": total[f"{kind}:cherry_picking"], "undecided": total[f"{kind}:undecided"],
                   "mean_shared": round(total[f"{kind}:shared"] / max(n, 1), 1)}
        if total[f"{kind}:released"]:
            r[kind]["mean_versions_to_release"] = round(
                total[f"{kind}:versions_to_release"] / total[f"{kind}:released"], 1)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--slope", type=float, nargs="+", default=[1.0, 3.0])
    ap.add_argument("--old-rule-seeds", type=int, default=20, help="seeds for the old rule's row (0: none)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    window = GuardConfig().pair_window
    rows = []
    for slope in args.slope:
        rows.append(row("window", list(range(args.seeds)), slope, window))
        if args.old_rule_seeds:
            rows.append(row("old rule", list(range(args.old_rule_seeds)), slope, 10**9, old_rule=True))
    print(f"\n{'rule':<10}{'slope':>6}{'seeds':>6}  {'kind':<10}{'probations':>11}{'released':>9}{'banned':>7}"
          f"{'undecided':>10}{'shared':>7}{'v to release':>13}")
    for r in rows:
        for kind in KINDS:
            k = r[kind]
            print(f"{r['rule']:<10}{r['slope']:>6}{r['seeds']:>6}  {kind:<10}{k['probations']:>11}"
                  f"{k['released']:>9}{k['banned']:>7}{k['undecided']:>10}{k['mean_shared']:>7}"
                  f"{k.get('mean_versions_to_release', '-'):>13}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()

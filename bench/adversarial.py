"""Adversarial report: every attack of tests/adversarial against a live trainer with honest nodes beside it.

    python bench/adversarial.py [--json FILE] [--honest-groups 1000] [--tree | --tree-only | --tree-issue29]
                                [--episodes | --episodes-only] [--honest-episodes 2000]

Starts a trainer (`swarm train`) and a real vLLM node, then:
  1. runs each attack with a fresh key and counts attempts, detections, and the attacker's groups that
     reached a trained batch (RUN/batches.jsonl; must be 0);
  2. feeds at least --honest-groups honest groups (the vLLM node, plus honest HF clients that sample from
     the published versions, each a new key that goes through probation) and counts false positives:
     honest groups refused or dropped for fraud, or honest keys struck (must be 0);
  3. the audit's cost as a share of the trainer's step time at the default audit rate;
  4. the cherry-picking test's detection power after M shared prompts, by simulation with the real
     paired z-test on rewards sampled from the starting policy (best-of-k against honest, G per group);
  5. with --tree (or --tree-only, which skips 1-4 and needs no vLLM): the relay tree's attacks by fresh
     identities (tests/adversarial/tree_attacks.py) against an origin and six honest `swarm relay`
     processes: honest relays banned, evicted or demoted, and version delivery time against the same lab
     unattacked, measured right before each attack.
  6. with --episodes (or --episodes-only): the attacks on multi-turn work (bench/adversarial_episodes.py),
     false positives over the honest episodes, the replay's cost, a replay bomb.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import torch  # noqa: E402

from bench.adversarial_episodes import episode_lab, print_episode_lab  # noqa: E402
from rewards.registry import make_task  # noqa: E402
from swarm_common import protocol as P  # noqa: E402
from swarm_common.keys import KeyPair  # noqa: E402
from tests.adversarial.attacks import ATTACKS, Ctx, item_from_prompt, reward_of  # noqa: E402
from tests.adversarial.conftest import HONEST, MAX_LAG, MAX_MESSAGE_BYTES, REGISTER_BURST, swarm_args  # noqa: E402
from tests.adversarial.evil_node import EvilNode, Sampler  # noqa: E402
from tests.adversarial.identity_attacks import IDENTITY_ATTACKS  # noqa: E402
from tests.conftest import Procs, free_port, get_json, wait_json  # noqa: E402
from trainer.config import RunConfig, TaskConfig  # noqa: E402
from trainer.guard import FRAUD, Guard, GuardConfig  # noqa: E402
from trainer.pairing import PairedRewards  # noqa: E402

FP_DROPS = ("cherry_picking", "fraud_on_probation", "banned_node")


def episodes_ok(res: dict) -> bool:
    """Every episode attack detected and none in a batch; no honest episode refused for fraud."""
    return (all(r["reached_batch"] == 0 and r["detected"] > 0 for r in res["attacks"])
            and res["honest"]["fraud_refusals"] == 0 and not res["honest"]["banned"])


def trained_counts(run_dir: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    path = run_dir / "batches.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        for g in json.loads(line)["groups"]:
            counts[g[0]] = counts.get(g[0], 0) + 1
    return counts


def honest_client(ctx: Ctx, name: str, stop: threading.Event, ids: list[str], prompts: int = 4) -> None:
    """An honest node without vLLM: samples with the published version's weights, submits as is."""
    ev = EvilNode(ctx.port, name)
    sampler = Sampler(ctx.sampler.run_dir, seed=len(ids) + 1)
    ids.append(ev.node_id)
    try:
        ev.register()
        while not stop.is_set():
            if (work := ev.ask(prompts)) is None:
                continue
            v = work.weights.version
            rollouts = [P.Rollout(a.assignment_id, sampler.sample(v, a.prompt_token_ids, ctx.group_size))
                        for a in work.assignments]
            ev.submit(v, rollouts)
    finally:
        ev.close()


def cherry_power(sampler: Sampler, task, group_size: int, ks: list[int], ms: list[int], pair_z: float,
                 pair_min: int, prompts: int = 96, pool: int = 64, trials: int = 400, seed: int = 0) -> dict:
    """P(the paired test fires after M shared prompts): best-of-k node vs an honest partner, and honest vs
    honest (the false-positive rate of the same rule), using trainer/guard.py's PairedRewards and thresholds."""
    from swarm_common.chat import encode_prompt

    items = task.train_items(seed=12345)
    sampler.model(0)
    tok = sampler.tok
    pools = []
    for _ in range(prompts):
        item = next(items)
        ids = encode_prompt(tok, item.prompt, task.system_prompt)
        assert item_from_prompt(tok, ids).answer == item.answer  # the cheater ranks by the true reward
        pools.append([reward_of(task, tok, item, s) for s in sampler.sample(0, ids, pool)])
    rng = random.Random(seed)
    guard = Guard.__new__(Guard)
    guard.cfg = GuardConfig(pair_z=pair_z, pair_min=pair_min)
    out: dict = {"pool_mean_reward": sum(map(sum, pools)) / (len(pools) * pool), "power": {}, "honest_fire": {}}
    for k in [1, *ks]:
        for m in ms:
            fired = 0
            for _ in range(trials):
                pairs = PairedRewards(window=0, is_reference=lambda node_id: node_id == "honest")
                for j in range(m):
                    rs = pools[rng.randrange(len(pools))]
                    draw = rng.sample(rs, group_size + k * group_size)
                    honest, picked = draw[:group_size], sorted(draw[group_size:], reverse=True)[:group_size]
                    pairs.add(str(j), "honest", 0, honest)
                    pairs.add(str(j), "node", 0, picked)
                guard.pairs = pairs
                fired += guard.cherry_picking("node")
            (out["honest_fire"] if k == 1 else out["power"].setdefault(f"best_of_{k}", {}))[m] = fired / trials
    return out


def tree_rows(root: Path, which: str = "all") -> list[dict]:
    """`which`: 'all', 'issue29' (only issue 29's attacks: keys that pass the origin's checks),
    'issue29-smart' (the same keys, smarter: they earn the origin's proof as leaves) or 'issue29-trusted'
    (the smart keys against honest relays the trainer calls established)."""
    import asyncio

    from tests.adversarial.tree_attacks import issue29_rows, issue29_smart_rows, run_all, stallers_first

    rows = []
    if which == "all":
        rows = asyncio.run(run_all(root / "tree"))
        rows.append(asyncio.run(stallers_first(root / "tree-first")))
    rows += asyncio.run(issue29_rows(root / "tree-29")) if which in ("all", "issue29") else []
    rows += asyncio.run(issue29_smart_rows(root / "tree-29s")) if which == "issue29-smart" else []
    rows += asyncio.run(issue29_smart_rows(root / "tree-29t", trusted=True)) if which == "issue29-trusted" else []

    def s(x: float | None, w: int) -> str:  # None: a version did not reach every honest relay in time
        return f"{'stopped':>{w}}" if x is None else f"{x:>{w}.2f}"
    print(f"\n{'tree attack':<24}{'attempts':>9}{'refused/contained':>19}{'honest banned/evicted/demoted':>31}"
          f"{'delivery s':>12}{'unattacked s':>14}{'ratio':>7}")
    for r in rows:
        harm = f"{r['honest_banned']}/{r['honest_evicted']}/{r['honest_demoted']}"
        print(f"{r['attack'][:23]:<24}{r['attempts']:>9}{r['detected']:>19}{harm:>31}{s(r['delivery_s'], 12)}"
              f"{r['unattacked_s']:>14.2f}{s(r['delivery_ratio'], 9)}")
    for r in rows:
        print(f"  {r['attack']}: {r['attempted']}; " + ", ".join(
            f"{k}={v}" for k, v in r.items() if k in ("joined", "stallers_with_children", "piece_requests_held",
                                                       "answers", "codes", "accepted", "peers_held", "seconds",
                                                       "first_version_s", "honest_penalized",
                                                       "attackers_with_standing", "checks_served",
                                                       "requests_trickled", "bytes", "refused")))
    if which == "all":
        print(f"  tracker's refusals and detections: {rows[3]['refused']}; with stallers first: {rows[4]['refused']}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    ap.add_argument("--honest-groups", type=int, default=1000, help="honest groups to check for false positives")
    ap.add_argument("--honest-clients", type=int, default=2, help="honest HF clients beside the vLLM node")
    ap.add_argument("--dir", default="/tmp/swarm-bench-adversarial", help="work directory (emptied first)")
    ap.add_argument("--tree", action="store_true", help="also run the relay tree's attacks")
    ap.add_argument("--tree-only", action="store_true", help="only the relay tree's attacks (no trainer, no vLLM)")
    ap.add_argument("--tree-issue29", action="store_true", help="only issue 29's tree attacks (keys that pass the "
                    "origin's checks: false reports, slow-loris, credit from friends; and leeching)")
    ap.add_argument("--tree-issue29-smart", action="store_true", help="the same keys, smarter: as leaves they "
                    "serve every request (only the origin asks a leaf), so they earn the origin's proof")
    ap.add_argument("--tree-issue29-trusted", action="store_true", help="the smart keys against honest relays "
                    "the trainer calls established (their keys trusted, as its own nodes are)")
    ap.add_argument("--episodes", action="store_true", help="also the attacks on multi-turn work (calculator)")
    ap.add_argument("--episodes-only", action="store_true", help="only the attacks on multi-turn work")
    ap.add_argument("--honest-episodes", type=int, default=2000, help="honest episodes to check for false positives")
    args = ap.parse_args()
    torch.set_num_threads(1)

    import shutil

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if args.episodes_only:
        res = episode_lab(root, args.honest_episodes)
        print_episode_lab(res)
        if args.json:
            Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode({"episodes": res})))
        return 0 if episodes_ok(res) else 1
    if args.tree_only or args.tree_issue29 or args.tree_issue29_smart or args.tree_issue29_trusted:
        which = ("issue29-trusted" if args.tree_issue29_trusted else "issue29-smart" if args.tree_issue29_smart
                 else "issue29" if args.tree_issue29 else "all")
        rows = tree_rows(root, which)
        if args.json:
            Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode({"tree": rows})))
        return 0 if all(r["honest_banned"] + r["honest_evicted"] + r["honest_demoted"] == 0 for r in rows) else 1
    run_dir = root / "run"
    zport, hport, tport = free_port(), free_port(), free_port()
    procs = Procs(root)
    defaults = RunConfig()
    tc = TaskConfig()
    task = make_task(tc.name, **tc.params)
    url = f"http://127.0.0.1:{hport}/api/summary"
    result: dict = {}
    try:
        t_start = time.monotonic()
        honest_key = KeyPair.load_or_create(root / "node" / "node.key").public_hex
        trainer = procs.start("trainer", *swarm_args(run_dir, zport, hport, tport, honest_key))
        wait_json(url, timeout=300, proc=trainer)
        # The starting policy, for the power simulation (retention removes it from the run later on).
        shutil.copytree(run_dir / "versions" / "v000000", root / "start" / "versions" / "v000000")
        procs.start("node", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir", str(root / "node"),
                    "--name", HONEST, "--max-prompts", "4")
        wait_json(url, lambda s: s["step"] >= 3, timeout=300, proc=trainer)
        print(f"trainer and honest node up in {time.monotonic() - t_start:.0f}s", flush=True)
        summary = lambda: get_json(url)  # noqa: E731
        sec = defaults.guard
        ctx = Ctx(zport, Sampler(run_dir), task, defaults.train.group_size, MAX_LAG,
                  sec.strikes_to_ban, MAX_MESSAGE_BYTES, summary)

        # 1. The attacks, one fresh key each.
        rows = []
        # The free-identity attacks come last: the registration flood empties the address's bucket.
        for name, attack in {**ATTACKS, **IDENTITY_ATTACKS}.items():
            t0 = time.monotonic()
            out = attack(ctx)
            rows.append({"attack": name, "attempts": out.attempts, "detected": out.detected,
                         "banned": out.banned, "codes": dict(out.codes), "node_ids": out.node_ids,
                         "steps_kept": out.steps_kept, "seconds": round(time.monotonic() - t0, 1)})
            print(f"  {name}: {out.attempts} attempts, {out.detected} detected, codes {dict(out.codes)}", flush=True)
        time.sleep(2 * REGISTER_BURST)  # the registration bucket refills (0.5/s) for the honest clients below
        after_attacks = summary()["step"]
        wait_json(url, lambda s: s["step"] >= after_attacks + 2, timeout=120)

        # 2. Honest traffic: new honest keys (through probation) beside the vLLM node, to >= N honest groups.
        stop = threading.Event()
        honest_ids: list[str] = []
        threads = [threading.Thread(target=honest_client, args=(ctx, f"honest-hf-{i}", stop, honest_ids), daemon=True)
                   for i in range(args.honest_clients)]
        for t in threads:
            t.start()

        def honest_rows(s):
            return [n for n in s["nodes"] if n["name"] == HONEST or n["node_id"] in honest_ids]

        t0 = time.monotonic()
        base = sum(n["accepted_groups"] for n in honest_rows(summary()))
        while True:
            s = summary()
            done = sum(n["accepted_groups"] for n in honest_rows(s)) - base
            if done >= args.honest_groups or time.monotonic() - t0 > 900:
                break
            time.sleep(2)
        stop.set()
        for t in threads:
            t.join(30)
        time.sleep(2)
        s = summary()
        hr = honest_rows(s)
        honest_groups = sum(n["accepted_groups"] for n in hr)
        fraud_refusals = sum(c for n in hr for r, c in n["refused"].items() if r in FRAUD)
        other_refusals = sum(c for n in hr for r, c in n["refused"].items() if r not in FRAUD)
        honest_banned = [n["name"] for n in hr if n["state"] == "banned"]

        # Reached a batch: groups of each attacker's keys in RUN/batches.jsonl.
        trained = trained_counts(run_dir)
        for r in rows:
            r["reached_batch"] = sum(trained.get(i, 0) for i in r["node_ids"])
        honest_trained = sum(trained.get(n["node_id"], 0) for n in hr)

        # 3. The audit's cost: seconds per audited group against the learner's seconds per trained group.
        steps = s["steps"]
        step_s = sum(x["step_seconds"] for x in steps)
        step_groups = sum(x["groups"] for x in steps)
        per_audit = s["audit_seconds"] / max(s["audits"], 1)
        per_group_step = step_s / max(step_groups, 1)
        audit_share = defaults.audit.rate * per_audit / per_group_step
        result = {
            "attacks": rows,
            "honest": {"groups": honest_groups, "groups_checked_here": done, "trained": honest_trained,
                       "fraud_refusals": fraud_refusals, "other_refusals": other_refusals,
                       "banned": honest_banned, "dropped": s["dropped"],
                       "false_positive_rate": (fraud_refusals + len(honest_banned)) / max(honest_groups, 1)},
            "audit": {"audits": s["audits"], "seconds": s["audit_seconds"], "seconds_per_group": per_audit,
                      "step_seconds_per_group": per_group_step, "default_rate": defaults.audit.rate,
                      "share_of_step_time": audit_share,
                      "share_measured_this_run": s["audit_seconds"] / max(step_s, 1e-9),
                      "calibration": s["audit_calibration"], "tolerance": defaults.audit.tol},
        }
    finally:
        procs.stop_all()

    # 4. Detection power of the paired test, on rewards of the starting policy.
    power = cherry_power(Sampler(root / "start"), task, defaults.train.group_size, [2, 4], [8, 16, 32, 64],
                         defaults.guard.pair_z, defaults.guard.pair_min)
    result["cherry_picking_power"] = power

    print()
    print(f"{'attack':<22}{'attempts':>9}{'detected':>10}{'reached a batch':>17}{'steps kept':>11}  codes")
    for r in result["attacks"]:
        kept = "-" if r.get("steps_kept") is None else f"{r['steps_kept']:.2f}"
        print(f"{r['attack']:<22}{r['attempts']:>9}{r['detected']:>10}{r['reached_batch']:>17}{kept:>11}  "
              f"{', '.join(f'{k}={v}' for k, v in sorted(r['codes'].items()))}")
    h = result["honest"]
    print(f"\nhonest nodes: {h['groups']} groups accepted ({h['groups_checked_here']} in the honest phase), "
          f"{h['trained']} trained; fraud refusals {h['fraud_refusals']}, banned {len(h['banned'])}, "
          f"false-positive rate {h['false_positive_rate']:.4f}; other refusals {h['other_refusals']}")
    a = result["audit"]
    print(f"audit: {a['audits']} audits, {1000 * a['seconds_per_group']:.1f} ms per group vs "
          f"{1000 * a['step_seconds_per_group']:.1f} ms of step time per group; at the default rate "
          f"{a['default_rate']:.0%} the audit costs {a['share_of_step_time']:.1%} of step time "
          f"(this run, with new nodes fully audited: {a['share_measured_this_run']:.1%})")
    c = a["calibration"]
    print(f"audit tolerance {a['tolerance']} nats; honest max |dlogp|: " +
          ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()))
    print(f"\ncherry-picking test (z > {defaults.guard.pair_z}, at least {defaults.guard.pair_min} shared "
          f"prompts, G={defaults.train.group_size}, starting policy's mean reward {power['pool_mean_reward']:.2f}):")
    print(f"{'M shared prompts':<18}" + "".join(f"{m:>8}" for m in power["honest_fire"]))
    for k, row in power["power"].items():
        print(f"{'power ' + k:<18}" + "".join(f"{v:>8.3f}" for v in row.values()))
    print(f"{'honest fires':<18}" + "".join(f"{v:>8.3f}" for v in power["honest_fire"].values()))
    if args.tree:
        result["tree"] = tree_rows(root)
    if args.episodes:
        result["episodes"] = episode_lab(root, args.honest_episodes)
        print_episode_lab(result["episodes"])
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    ok = all(r["reached_batch"] == 0 for r in result["attacks"]) and h["false_positive_rate"] == 0
    ok = ok and all(r["honest_banned"] + r["honest_evicted"] + r["honest_demoted"] == 0 for r in result.get("tree", []))
    ok = ok and ("episodes" not in result or episodes_ok(result["episodes"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

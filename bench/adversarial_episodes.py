"""The episode attacks of bench/adversarial.py (--episodes): a trainer running the calculator environment, an
honest vLLM node, the attacks of tests/adversarial/episode_attacks.py one fresh key each, an honest HF
client that runs episodes as a stranger through probation, the false positives over the honest episodes,
the replay's and audit's cost against the learner's step, and a replay bomb against the python tool.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from rewards.registry import make_task
from swarm_common import protocol as P
from swarm_common.keys import KeyPair
from tests.adversarial.attacks import Ctx
from tests.adversarial.conftest import HONEST, MAX_MESSAGE_BYTES, swarm_args
from tests.adversarial.episode_attacks import EPISODE_ATTACKS, EpisodeSampler, _heartbeat
from tests.adversarial.evil_node import EvilNode, Sampler
from tests.adversarial.test_episode_attacks import EPISODE_LAG, EPISODE_RUN, EXPECTED
from tests.conftest import Procs, free_port, get_json, wait_json
from trainer.guard import FRAUD


def honest_episode_client(ctx: Ctx, stop: threading.Event, ids: list[str]) -> None:
    """A stranger that runs its episodes honestly (HF sampling, the node's rules) and submits them as they are."""
    ev = EvilNode(ctx.port, "honest-hf-episodes")
    ids.append(ev.node_id)
    sampler = EpisodeSampler(ctx)
    try:
        ev.register()
        while not stop.is_set():
            ev.send(P.WorkRequest(node_id=ev.node_id, version_loaded=ev.version, max_prompts=2))
            work = ev.recv()
            if not isinstance(work, P.WorkAssignment):
                continue
            ev.version = max(ev.version, work.weights.version)
            if not work.assignments:
                time.sleep(work.retry_after_s or 0.2)
                continue
            v = work.weights.version
            rollouts = []
            for a in work.assignments:
                eps = sampler.episodes(work, a, ctx.group_size, v, lambda v=v: _heartbeat(ev, v))
                rollouts.append(P.Rollout(a.assignment_id, [], [
                    sampler.submit_form(v, a.prompt_token_ids, te.ids, te.mask, te.finish) for te in eps]))
            ev.submit(v, rollouts)
    finally:
        ev.close()


def replay_bomb(tmp: Path, groups: int = 4, budget_s: float = 2.0) -> dict:
    """Episodes whose every call is an endless loop, to a trainer's node service running the python tool (no
    audit: an established node's unaudited group). Seconds until the answer, against the budget."""
    tmp.mkdir(parents=True, exist_ok=True)
    from rewards.sandbox import available
    from swarm_common.keys import KeyPair
    from tests.test_episode_service import _register, episodes, serve
    from tests.test_server_work import Client

    if available():
        return {"skipped": available()}

    async def go() -> dict:
        kp = KeyPair.generate()
        srv = await serve(tmp, "python", [kp.public_hex], replay_sandbox_s=budget_s, max_episode_tokens=400)
        c = Client(srv.cfg.server.port, kp)
        try:
            await _register(c)
            await c.ask(groups)
            work = await c.recv()
            loop = "[python('while True: pass')]"
            rollouts = [P.Rollout(a.assignment_id, [], episodes(work, a, [loop, loop, "1"])) for a in work.assignments]
            t0 = time.monotonic()
            await c.send(P.RolloutSubmission(node_id=kp.public_hex, version=0, rollouts=rollouts, gen_seconds=0.1))
            res = await c.recv(timeout=300)
            spent = time.monotonic() - t0
            calls = sum(e.mask.count(False) > 0 for r in rollouts for e in r.episodes) * 2
            return {"groups": len(rollouts), "calls_sent": calls, "budget_s": budget_s * len(rollouts),
                    "answer_s": round(spent, 2), "codes": sorted(set(res.refused.values())),
                    "suspect": kp.public_hex in srv.guard.suspects, "strikes": srv.guard.strikes[kp.public_hex],
                    "unbounded_s": calls * srv.intake.env.limits.cpu_s}
        finally:
            c.close()
            await srv.stop()

    return asyncio.run(go())


def episode_lab(root: Path, honest_episodes: int) -> dict:
    run_dir = root / "episodes-run"
    zport, hport, tport = free_port(), free_port(), free_port()
    procs = Procs(root)
    url = f"http://127.0.0.1:{hport}/api/summary"
    out: dict = {}
    try:
        honest_key = KeyPair.load_or_create(root / "episodes-node" / "node.key").public_hex
        trainer = procs.start("episodes-trainer", *swarm_args(run_dir, zport, hport, tport, honest_key, EPISODE_RUN))
        wait_json(url, timeout=300, proc=trainer)
        procs.start("episodes-node", "node", "--trainer", f"127.0.0.1:{zport}", "--data-dir",
                    str(root / "episodes-node"), "--name", HONEST, "--max-prompts", "4")
        wait_json(url, lambda s: s["step"] >= 3, timeout=300, proc=trainer)
        summary = lambda: get_json(url)  # noqa: E731
        sampler = Sampler(run_dir)
        sampler.model(sampler.versions()[-1])
        ctx = Ctx(zport, sampler, make_task("calculator", digits=3, terms=2), 8, EPISODE_LAG, 3, MAX_MESSAGE_BYTES,
                  summary)
        rows = []
        for name, attack in EPISODE_ATTACKS.items():
            t0 = time.monotonic()
            o = attack(ctx)
            rows.append({"attack": name, "attempts": o.attempts, "detected": o.detected, "banned": o.banned,
                         "codes": dict(o.codes), "node_ids": o.node_ids, "expected": sorted(EXPECTED.get(name, [])),
                         "seconds": round(time.monotonic() - t0, 1)})
            print(f"  {name}: {o.attempts} attempts, {o.detected} detected, codes {dict(o.codes)}", flush=True)
        # Honest episodes: the vLLM node and an honest stranger, to at least `honest_episodes` accepted.
        stop, ids = threading.Event(), []
        t = threading.Thread(target=honest_episode_client, args=(ctx, stop, ids), daemon=True)
        t.start()

        def honest(s):
            return [n for n in s["nodes"] if n["name"] == HONEST or n["node_id"] in ids]

        base = sum(n["accepted_groups"] for n in honest(summary()))
        t0 = time.monotonic()
        while (sum(n["accepted_groups"] for n in honest(summary())) - base) * 8 < honest_episodes:
            if time.monotonic() - t0 > 1200:
                break
            time.sleep(2)
        stop.set()
        t.join(60)
        s = summary()
        hr = honest(s)
        trained: dict[str, int] = {}
        for line in (run_dir / "batches.jsonl").read_text().splitlines():
            for g in json.loads(line)["groups"] if line.strip() else []:
                trained[g[0]] = trained.get(g[0], 0) + 1
        for r in rows:
            r["reached_batch"] = sum(trained.get(i, 0) for i in r["node_ids"])
        steps = s["steps"]
        step_g = sum(x["step_seconds"] for x in steps) / max(sum(x["groups"] for x in steps), 1)
        replay_g = s["replay_seconds"] / max(s["accepted_groups"], 1)
        audit_g = s["audit_seconds"] / max(s["audits"], 1)
        out = {"attacks": rows, "honest": {
            "episodes": 8 * sum(n["accepted_groups"] for n in hr), "checked_here": 8 * (sum(n["accepted_groups"] for n in hr) - base),
            "stranger_groups": sum(n["accepted_groups"] for n in hr if n["node_id"] in ids),
            "fraud_refusals": sum(c for n in hr for r, c in n["refused"].items() if r in FRAUD),
            "other_refusals": {r: c for n in hr for r, c in n["refused"].items() if r not in FRAUD},
            "banned": [n["name"] for n in hr if n["state"] == "banned"]},
            "cost": {"replay_s_per_group": replay_g, "audit_s_per_group": audit_g, "step_s_per_group": step_g,
                     "share_at_default_rate": (replay_g + 0.1 * audit_g) / step_g,
                     "share_this_run": (s["replay_seconds"] + s["audit_seconds"]) / max(sum(x["step_seconds"] for x in steps), 1e-9)}}
    finally:
        procs.stop_all()
    out["replay_bomb"] = replay_bomb(root / "bomb")
    return out


def print_episode_lab(res: dict) -> None:
    print(f"\n{'episode attack':<30}{'attempts':>9}{'detected':>10}{'banned':>8}{'reached a batch':>17}  codes")
    for r in res["attacks"]:
        print(f"{r['attack']:<30}{r['attempts']:>9}{r['detected']:>10}{str(r['banned']):>8}{r['reached_batch']:>17}  "
              + ", ".join(f"{k}={v}" for k, v in sorted(r["codes"].items())))
    h, c, b = res["honest"], res["cost"], res["replay_bomb"]
    print(f"\nhonest episodes: {h['episodes']} accepted ({h['checked_here']} in the honest phase; a stranger's "
          f"{h['stranger_groups']} groups), fraud refusals {h['fraud_refusals']}, banned {len(h['banned'])}; other "
          f"refusals {h['other_refusals'] or '-'}")
    print(f"replay {1000 * c['replay_s_per_group']:.1f} ms + audit {1000 * c['audit_s_per_group']:.1f} ms per group "
          f"vs {1000 * c['step_s_per_group']:.1f} ms of learner step per group: {c['share_at_default_rate']:.1%} at the "
          f"default audit rate (this run, new nodes audited in full: {c['share_this_run']:.1%})")
    if "skipped" in b:
        print(f"replay bomb: skipped ({b['skipped']})")
    else:
        print(f"replay bomb: {b['groups']} groups, {b['calls_sent']} endless calls (up to {b['unbounded_s']} s of CPU "
              f"at the per-call limit; forever without it): answered in {b['answer_s']} s against a budget of "
              f"{b['budget_s']} s, codes {b['codes']}, node audited in full from then on: {b['suspect']}, strikes "
              f"{b['strikes']}")
